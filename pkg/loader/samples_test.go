//go:build linux

package loader

import (
	"net/netip"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/privtest"
)

// TestSamplesReadWhetherOrNotTheyWake: the kernel wakes the sample reader
// for a record only if none woke it in the last wakeEvery, so most of a
// burst of connects comes without a wakeup and is found by polling; once
// the reader is quiet it stops polling and waits, and the next record
// wakes it. Every sample of each burst is read, after quiet spells too.
func TestSamplesReadWhetherOrNotTheyWake(t *testing.T) {
	d, cg := open(t)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	put(t, d, Rule{Name: "burst", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Samples: true})
	samples := openSamples(t, d)
	privtest.Join(t, cg)

	type read struct {
		n   int
		err error
	}
	for _, burst := range []int{1, 200, 1, 50} {
		// The reader waits for the burst's first record from before it
		// starts: a quiet spell of several polls.
		got := make(chan read, 1)
		go func() {
			samples.SetDeadline(time.Now().Add(time.Minute))
			n := 0
			for n < burst {
				s, err := samples.Read()
				if err != nil {
					got <- read{n, err}
					return
				}
				if s.Rule == "burst" && s.Kind == SampleConnect {
					n++
				}
			}
			got <- read{n, nil}
		}()
		// The reader's polls time out on the real clock: a quiet spell of several.
		time.Sleep(3 * pollEvery)
		for range burst {
			c, err := connect(srv)
			if err != nil {
				t.Fatal(err)
			}
			c.Close()
		}
		// A poll finds what did not wake the reader within pollEvery; a
		// reader that only waited would sit until its deadline.
		select {
		case r := <-got:
			if r.err != nil || r.n != burst {
				t.Fatalf("burst of %d connects: read %d samples, %v", burst, r.n, r.err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("burst of %d connects: its samples not read in 10s", burst)
		}
	}
	lost, err := d.Lost()
	if err != nil || lost != (Lost{}) {
		t.Fatalf("lost %+v, %v", lost, err)
	}
}
