// Package testport picks loopback ports for servers a test starts on a
// port of its choosing (a process given an address, a server restarted
// on the same port).
package testport

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// lowest is the first port Free picks: above the ports of well-known
// services.
const lowest = 10000

// Free returns a loopback port that no socket holds now, nor port+o for
// each o in also (a Redis cluster node's bus port, 10000 above). It picks
// below the kernel's ephemeral range where it can: a port from that range
// may become some connection's local port (a test's client, or one of the
// many sockets in TIME_WAIT after a test that churns connections) before
// the server binds it, or while a test has the server stopped. Another
// process may still bind it first; a caller that can should retry on
// another port when its server fails to start.
func Free(t testing.TB, also ...int) int {
	t.Helper()
	low := ephemeralLow()
	top := low - 1
	for _, o := range also {
		top = min(top, low-1-o)
	}
	for i := 0; top-lowest >= 1000 && i < 100; i++ {
		p := lowest + rand.IntN(top-lowest+1)
		ok := bindable(p)
		for _, o := range also {
			ok = ok && bindable(p+o)
		}
		if ok {
			return p
		}
	}
	// An unusual ephemeral range: the kernel's choice, as good as any.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// ephemeralLow is the first port of the range the kernel picks local
// ports from (net.ipv4.ip_local_port_range); 0 if unknown.
func ephemeralLow() int {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) != 2 {
		return 0
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return lo
}

func bindable(port int) bool {
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}
