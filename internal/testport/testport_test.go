package testport

import (
	"net"
	"strconv"
	"testing"
)

func TestFreeBelowTheEphemeralRange(t *testing.T) {
	lo := ephemeralLow()
	if lo-10000-lowest < 1000 {
		t.Skipf("ephemeral range from %d: too low for Free to pick below it", lo)
	}
	for range 20 {
		p := Free(t, 10000)
		if p < lowest || p+10000 >= lo {
			t.Fatalf("Free = %d, want within [%d, %d)", p, lowest, lo-10000)
		}
		for _, q := range []int{p, p + 10000} {
			ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(q))
			if err != nil {
				t.Fatalf("port %d from Free: %v", q, err)
			}
			ln.Close()
		}
	}
}

func TestBindable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := ln.Addr().(*net.TCPAddr).Port
	if bindable(p) {
		t.Errorf("port %d is held by a listener, but bindable says it is free", p)
	}
	ln.Close()
	if !bindable(p) {
		t.Errorf("port %d is free again, but bindable says it is not", p)
	}
}
