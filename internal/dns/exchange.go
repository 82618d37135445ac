package dns

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// maxUDPReply is the receive buffer for UDP replies: the largest UDP
// payload, so that the kernel never cuts a reply from a server that ignores
// the size we advertise.
const maxUDPReply = 65535

// exchange asks server one question over UDP, and again over TCP if the
// reply is truncated, and reads the answer.
func (r *Resolver) exchange(ctx context.Context, server, qname string, qtype dnsmessage.Type) (result, error) {
	m, err := r.roundTrip(ctx, "udp", server, qname, qtype)
	if err == nil && m.truncated {
		m, err = r.roundTrip(ctx, "tcp", server, qname, qtype)
		if err == nil && m.truncated {
			err = errTruncatedTCP
		}
	}
	if err != nil {
		return result{}, err
	}
	return answer(m, qname, qtype)
}

// roundTrip sends one query, with a fresh random ID, over network ("udp" or
// "tcp") and returns the reply, within r's Timeout.
func (r *Resolver) roundTrip(ctx context.Context, network, server, qname string, qtype dnsmessage.Type) (*message, error) {
	timeout := r.timeout()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// math/rand/v2's global source is ChaCha8, seeded from the OS: the ID
	// cannot be predicted by an off-path attacker.
	id := uint16(rand.Uint32())
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, server)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	// The connection's own deadline is only the query's timeout; when the
	// caller's ctx ends first, this wakes the blocked read, after ctx.Err
	// is set, so that the caller tells the two apart.
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	var m *message
	if network == "tcp" {
		m, err = roundTripTCP(conn, id, qname, qtype)
	} else {
		m, err = roundTripUDP(conn, id, qname, qtype)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = fmt.Errorf("no reply over %s within %v: %w", network, timeout, err)
	}
	return m, err
}

// roundTripUDP sends the query and reads datagrams until one is its reply.
// Others - malformed, another ID, another question - are ignored: they may
// be forged, and the real reply may still come. The socket is connected, so
// the kernel drops datagrams from any other address.
func roundTripUDP(conn net.Conn, id uint16, qname string, qtype dnsmessage.Type) (*message, error) {
	query, err := appendQuery(nil, id, qname, qtype)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Write(query); err != nil {
		return nil, err
	}
	buf := make([]byte, maxUDPReply)
	var ignored error
	for {
		n, err := conn.Read(buf)
		if err != nil {
			if ignored != nil {
				err = fmt.Errorf("%w (ignored a reply: %v)", err, ignored)
			}
			return nil, err
		}
		m, err := readReply(buf[:n], id, qname, qtype)
		if err != nil {
			ignored = err
			continue
		}
		return m, nil
	}
}

// roundTripTCP sends the query with its two-byte length prefix (RFC 1035
// §4.2.2) and reads one reply, which must be the query's: nobody can
// inject into the connection without guessing the TCP sequence numbers.
func roundTripTCP(conn net.Conn, id uint16, qname string, qtype dnsmessage.Type) (*message, error) {
	query, err := appendQuery([]byte{0, 0}, id, qname, qtype)
	if err != nil {
		return nil, err
	}
	binary.BigEndian.PutUint16(query, uint16(len(query)-2))
	if _, err := conn.Write(query); err != nil {
		return nil, err
	}
	var n [2]byte
	if _, err := io.ReadFull(conn, n[:]); err != nil {
		return nil, err
	}
	buf := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(conn, buf); err != nil {
		return nil, err
	}
	return readReply(buf, id, qname, qtype)
}
