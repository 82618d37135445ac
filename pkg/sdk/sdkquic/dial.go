package sdkquic

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/egressd/egressd/pkg/sdk"
)

// Dial opens a QUIC connection to addr (host:port) on a UDP socket of its
// own, which is closed when the connection is, as quic.DialAddr does. A
// dial whose first packets the kernel refused (egressd's rule, or a
// firewall) fails with an error that also wraps the send's *net.OpError,
// marked with when the dial began (see [sdk.WithDialStart]).
func Dial(ctx context.Context, addr string, tlsConf *tls.Config, conf *quic.Config) (*quic.Conn, error) {
	return dial(ctx, addr, tlsConf, conf, false)
}

// DialEarly is [Dial] for a connection that may send 0-RTT data, as
// quic.DialAddrEarly; http3.Transport's own dial is early.
func DialEarly(ctx context.Context, addr string, tlsConf *tls.Config, conf *quic.Config) (*quic.Conn, error) {
	return dial(ctx, addr, tlsConf, conf, true)
}

func dial(ctx context.Context, addr string, tlsConf *tls.Config, conf *quic.Config, early bool) (*quic.Conn, error) {
	if tlsConf == nil {
		return nil, errors.New("quic dial: tls.Config not set")
	}
	raddr, host, err := resolve(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("quic dial %s: %w", addr, err)
	}
	udp, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4zero})
	if err != nil {
		return nil, fmt.Errorf("quic dial %s: %w", addr, err)
	}
	pc := &refusalConn{UDPConn: udp}
	// The server name comes from the name dialled, as quic.DialAddr's,
	// not from the address it resolved to.
	if tlsConf.ServerName == "" {
		tlsConf = tlsConf.Clone()
		tlsConf.ServerName = host
	}
	started := time.Now()
	var conn *quic.Conn
	if early {
		conn, err = quic.DialEarly(ctx, pc, raddr, tlsConf, conf)
	} else {
		conn, err = quic.Dial(ctx, pc, raddr, tlsConf, conf)
	}
	if err != nil {
		udp.Close()
		if send := pc.refusal(); send != nil {
			err = &refusedError{dial: err, send: send}
		}
		return nil, sdk.WithDialStart(err, started)
	}
	go func() {
		<-conn.Context().Done()
		udp.Close()
	}()
	return conn, nil
}

// resolve returns the UDP address of addr and the host it names.
func resolve(ctx context.Context, addr string) (*net.UDPAddr, string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, "", err
	}
	var r net.Resolver
	p, err := r.LookupPort(ctx, "udp", port)
	if err != nil {
		return nil, "", err
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		ips, err := r.LookupNetIP(ctx, "ip", host)
		if err != nil {
			return nil, "", err
		}
		if len(ips) == 0 {
			return nil, "", fmt.Errorf("no address for %s", host)
		}
		ip = ips[0]
	}
	return net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip.Unmap(), uint16(p))), host, nil
}

// refusedError is a dial that failed because a send was refused. It reads
// as the dial's error and wraps the send's too, for errors.As to find.
type refusedError struct {
	dial error
	send error
}

func (e *refusedError) Error() string   { return e.dial.Error() }
func (e *refusedError) Unwrap() []error { return []error{e.dial, e.send} }

// refusalConn is a UDP socket that remembers the first of its sends the
// kernel refused with EPERM, and sends nothing after it: quic-go reports
// the failure only as text, and would go on to send its close, which the
// rule would count as another refusal, or admit as a flow of a connection
// that failed already (a per-second rule's token spent for nothing).
type refusalConn struct {
	*net.UDPConn
	mu      sync.Mutex
	refused error
}

func (c *refusalConn) WriteMsgUDP(b, oob []byte, addr *net.UDPAddr) (int, int, error) {
	if err := c.refusal(); err != nil {
		return 0, 0, err
	}
	n, oobn, err := c.UDPConn.WriteMsgUDP(b, oob, addr)
	c.note(err)
	return n, oobn, err
}

func (c *refusalConn) WriteTo(b []byte, addr net.Addr) (int, error) {
	if err := c.refusal(); err != nil {
		return 0, err
	}
	n, err := c.UDPConn.WriteTo(b, addr)
	c.note(err)
	return n, err
}

func (c *refusalConn) note(err error) {
	if err == nil || !errors.Is(err, syscall.EPERM) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.refused == nil {
		c.refused = err
	}
}

// refusal is the send the kernel refused; nil if none was.
func (c *refusalConn) refusal() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refused
}

var _ quic.OOBCapablePacketConn = (*refusalConn)(nil)
