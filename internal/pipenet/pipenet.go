// Package pipenet is an in-memory network for tests: servers listen on an
// address, clients dial it, and each connection is a net.Pipe.
//
// A goroutine blocked on a loopback socket is not durably blocked in the
// sense of testing/synctest, so a bubble whose server or client waits on
// one never moves its fake clock; a goroutine blocked on a pipe made in
// the bubble is. An HTTP or gRPC server and its clients on a Network can
// therefore run inside a bubble, and a test of their timing (backoff,
// hedging, deadlines) takes no real time.
package pipenet

import (
	"context"
	"net"
	"os"
	"sync"
	"syscall"
)

// Network is a set of listeners by address. The zero Network is empty and
// ready to use; it is safe for concurrent use.
type Network struct {
	mu        sync.Mutex
	listeners map[string]*Listener
}

// Listen listens on addr, which must not be in use.
func (n *Network) Listen(addr string) (*Listener, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.listeners[addr]; ok {
		return nil, &net.OpError{Op: "listen", Net: "pipe", Addr: Addr(addr), Err: os.NewSyscallError("bind", syscall.EADDRINUSE)}
	}
	if n.listeners == nil {
		n.listeners = map[string]*Listener{}
	}
	l := &Listener{n: n, addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
	n.listeners[addr] = l
	return l, nil
}

// DialContext connects to the listener on addr, as net.Dialer.DialContext
// does (network is not read): the connection is refused when nothing
// listens there, as a closed port's is.
func (n *Network) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	n.mu.Lock()
	l := n.listeners[addr]
	n.mu.Unlock()
	refused := &net.OpError{Op: "dial", Net: network, Addr: Addr(addr), Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	if l == nil {
		return nil, refused
	}
	client, server := net.Pipe()
	select {
	case l.conns <- server:
		return client, nil
	case <-l.done:
	case <-ctx.Done():
		refused.Err = ctx.Err()
	}
	client.Close()
	server.Close()
	return nil, refused
}

// Listener is a net.Listener on a Network.
type Listener struct {
	n     *Network
	addr  string
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

var _ net.Listener = (*Listener)(nil)

// Accept waits for the next connection.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, &net.OpError{Op: "accept", Net: "pipe", Addr: Addr(l.addr), Err: net.ErrClosed}
	}
}

// Close stops listening: the address is free again, and dials to it are
// refused. Connections already accepted stay open.
func (l *Listener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.n.mu.Lock()
		delete(l.n.listeners, l.addr)
		l.n.mu.Unlock()
	})
	return nil
}

// Addr returns the address listened on.
func (l *Listener) Addr() net.Addr { return Addr(l.addr) }

// Addr is an address on a Network.
type Addr string

// Network returns "pipe".
func (Addr) Network() string { return "pipe" }

func (a Addr) String() string { return string(a) }
