//go:build linux

package loader

import (
	"io"
	"net/netip"
	"syscall"
	"testing"

	"github.com/egressd/egressd/internal/privtest"
)

func TestConcurrencyLimit(t *testing.T) {
	d, cg := open(t)
	srv4 := listen(t, "tcp4", "127.0.0.1:0")
	srv6 := listen(t, "tcp6", "[::1]:0")
	srvDual := listen(t, "tcp", "[::]:0")
	privtest.Join(t, cg)

	tests := []struct {
		name   string
		dest   netip.Prefix
		target netip.AddrPort
	}{
		{"ipv4", netip.MustParsePrefix("127.0.0.1/32"), srv4},
		{"ipv6", netip.MustParsePrefix("::1/128"), srv6},
		// An AF_INET6 socket to a v4-mapped address meets the IPv4 rule.
		{"v4-mapped", netip.MustParsePrefix("127.0.0.2/32"), netip.AddrPortFrom(netip.MustParseAddr("::ffff:127.0.0.2"), srvDual.Port())},
	}
	const limit = 3
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			put(t, d, Rule{Name: tt.name, Dest: tt.dest, Port: tt.target.Port(), Shape: ShapeConcurrency, Limit: limit})
			var held []io.Closer
			for range limit {
				held = append(held, dial(t, tt.target))
			}
			dialRefused(t, tt.target, syscall.EPERM)
			held[0].Close()
			waitLive(t, d, tt.name, limit-1)
			dial(t, tt.target)
			dialRefused(t, tt.target, syscall.EPERM)
			s := stats(t, d, tt.name)
			if s.Admitted != limit+1 || s.Refused != 2 || s.Live != limit {
				t.Fatalf("stats %+v: want admitted %d refused 2 live %d", s, limit+1, limit)
			}
		})
	}
}
