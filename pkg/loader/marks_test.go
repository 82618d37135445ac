//go:build linux

package loader

import (
	"io"
	"net"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// TestOtherProgramsFlags: another program that clears, sets or turns over
// the callback flags egressd marks its sockets with, attached above or
// below egressd's cgroup, costs no slot: every connection's comes back,
// however it ends. Before sock_release looked for a socket's state by its
// cookie rather than its mark, a program that cleared the mark made
// egressd keep the slot of every connection it saw.
func TestOtherProgramsFlags(t *testing.T) {
	const limit = 3
	for _, tc := range []struct {
		name  string
		below bool
		how   privtest.Flip
	}{
		{"clears, above", false, privtest.FlipClear},
		{"clears, below", true, privtest.FlipClear},
		{"sets, above", false, privtest.FlipSet},
		{"sets, below", true, privtest.FlipSet},
		{"toggles, above", false, privtest.FlipToggle},
		{"toggles, below", true, privtest.FlipToggle},
	} {
		t.Run(tc.name, func(t *testing.T) {
			privtest.RequireRoot(t)
			above := privtest.Cgroup(t, "marks")
			mid := privtest.SubCgroup(t, above, "egressd")
			below := privtest.SubCgroup(t, mid, "service")
			d := openOn(t, mid)
			put(t, d, Rule{Name: "local", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: limit})
			privtest.AttachFlipper(t, map[bool]string{false: above, true: below}[tc.below], tc.how)
			closeFirst, reset, holder := closeFirstServer(t), resetServer(t), listen(t, "tcp4", "127.0.0.1:0")
			closed := closedPort(t)
			privtest.Join(t, below)
			for i := range 3 * limit {
				for _, srv := range []netip.AddrPort{closeFirst, reset} {
					c, err := net.Dial("tcp4", srv.String())
					if err != nil {
						t.Fatalf("connection %d to %s: %v", i, srv, err)
					}
					c.Write([]byte{1})
					io.Copy(io.Discard, c)
					c.Close()
				}
				c, err := net.Dial("tcp4", holder.String())
				if err != nil {
					t.Fatalf("connection %d to %s: %v", i, holder, err)
				}
				c.Close()
				// A connect() the peer refuses, connected again on the
				// same socket and then closed.
				fd := socket4(t, 0)
				for range 2 {
					if err := unix.Connect(fd, sa4(closed)); err != unix.ECONNREFUSED {
						t.Fatalf("connect to a closed port: %v", err)
					}
				}
				unix.Close(fd)
			}
			waitLive(t, d, "local", 0)
			checkRecount(t, d, "local", 0)
		})
	}
}
