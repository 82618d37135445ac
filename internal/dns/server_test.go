package dns

import (
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testRR is a record a testServer answers from.
type testRR struct {
	name  string // lower case, trailing dot
	rtype uint16
	ttl   uint32
	data  string // an address (A, AAAA), a name (CNAME), ignored otherwise
}

// serverConfig says how a testServer behaves.
type serverConfig struct {
	records []testRR
	// soaTTL and soaMinimum, when soaTTL is set, make negative answers
	// carry an SOA record in the authority section.
	soaTTL, soaMinimum uint32
	// rcode, when set, is the RCODE of every reply, which has no records.
	rcode int
	// lame replies without RA (and without AA).
	lame bool
	// truncateUDP replies over UDP with TC set and no records;
	// truncateTCP does the same over TCP.
	truncateUDP, truncateTCP bool
	// forge sends, before each UDP reply, one with the wrong ID, one for
	// another question, one with QR unset and one that does not parse.
	forge bool
	// delay holds each reply back; silent drops every query.
	delay  time.Duration
	silent bool
}

// testServer is a DNS server on 127.0.0.1, UDP and TCP on the same port,
// answering from a table like a recursive resolver would: CNAME chains
// followed, NXDOMAIN for names it has no records for.
type testServer struct {
	serverConfig
	addr string

	udp  net.PacketConn
	tcp  net.Listener
	done chan struct{}
	wg   sync.WaitGroup

	mu      sync.Mutex
	conns   map[net.Conn]bool
	queries [][]byte // every query received, UDP and TCP

	udpQueries, tcpQueries atomic.Int32
}

func startServer(t *testing.T, cfg serverConfig) *testServer {
	t.Helper()
	s := &testServer{serverConfig: cfg, done: make(chan struct{}), conns: map[net.Conn]bool{}}
	// The resolver retries over TCP on the UDP port: find a port free for
	// both.
	for attempt := 0; ; attempt++ {
		udp, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		tcp, err := net.Listen("tcp4", udp.LocalAddr().String())
		if err == nil {
			s.udp, s.tcp, s.addr = udp, tcp, udp.LocalAddr().String()
			break
		}
		udp.Close()
		if attempt == 20 {
			t.Fatalf("no port free for UDP and TCP: %v", err)
		}
	}
	s.wg.Go(s.serveUDP)
	s.wg.Go(s.serveTCP)
	t.Cleanup(s.close)
	return s
}

func (s *testServer) close() {
	close(s.done)
	s.udp.Close()
	s.tcp.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// wait holds a reply back by s.delay; false means the server is closing.
func (s *testServer) wait() bool {
	select {
	case <-time.After(s.delay):
		return true
	case <-s.done:
		return false
	}
}

func (s *testServer) serveUDP() {
	for {
		buf := make([]byte, 2048)
		n, from, err := s.udp.ReadFrom(buf)
		if err != nil {
			return
		}
		s.udpQueries.Add(1)
		s.wg.Go(func() {
			q := s.record(buf[:n])
			if s.silent || !s.wait() {
				return
			}
			if s.forge {
				for _, forged := range s.forgeries(q) {
					s.udp.WriteTo(forged, from)
				}
			}
			if reply := s.reply(q, false); reply != nil {
				s.udp.WriteTo(reply, from)
			}
		})
	}
}

func (s *testServer) serveTCP() {
	for {
		c, err := s.tcp.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns[c] = true
		s.mu.Unlock()
		s.wg.Go(func() {
			defer func() {
				s.mu.Lock()
				delete(s.conns, c)
				s.mu.Unlock()
				c.Close()
			}()
			for {
				var n [2]byte
				if _, err := io.ReadFull(c, n[:]); err != nil {
					return
				}
				buf := make([]byte, binary.BigEndian.Uint16(n[:]))
				if _, err := io.ReadFull(c, buf); err != nil {
					return
				}
				s.tcpQueries.Add(1)
				q := s.record(buf)
				if s.silent || !s.wait() {
					return
				}
				reply := s.reply(q, true)
				if reply == nil {
					return
				}
				c.Write(binary.BigEndian.AppendUint16(nil, uint16(len(reply))))
				c.Write(reply)
			}
		})
	}
}

func (s *testServer) record(query []byte) *message {
	s.mu.Lock()
	s.queries = append(s.queries, append([]byte(nil), query...))
	s.mu.Unlock()
	q, err := parseMessage(query)
	if err != nil || len(q.questions) != 1 {
		return nil
	}
	return q
}

func (s *testServer) received() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.queries...)
}

// reply builds the reply to q, or nil for a query it cannot read.
func (s *testServer) reply(q *message, tcp bool) []byte {
	if q == nil {
		return nil
	}
	qq := q.questions[0]
	w := newMsgWriter(q.id, qq)
	flags := uint16(flagQR | flagRD | flagRA)
	if s.lame {
		flags &^= flagRA
	}
	switch {
	case s.rcode != 0:
		flags |= uint16(s.rcode)
	case s.truncateUDP && !tcp, s.truncateTCP && tcp:
		flags |= flagTC
	default:
		name, known := qq.name, false
		for hops := 0; hops < 8; hops++ {
			target := ""
			known = false
			for _, rr := range s.records {
				if rr.name != name {
					continue
				}
				known = true
				switch rr.rtype {
				case typeCNAME:
					w.cname(rr.name, rr.ttl, rr.data)
					target = rr.data
				case qq.qtype:
					w.addr(rr.name, rr.rtype, rr.ttl, netip.MustParseAddr(rr.data))
				}
			}
			if target == "" {
				break
			}
			name = target
		}
		if !known {
			flags |= rcodeNXDomain
		}
		if w.addrs == 0 && s.soaTTL != 0 {
			w.soa(s.soaTTL, s.soaMinimum)
		}
	}
	return w.bytes(flags)
}

// forgeries are replies to q that the resolver must ignore.
func (s *testServer) forgeries(q *message) [][]byte {
	if q == nil {
		return nil
	}
	qq := q.questions[0]
	wrongID := newMsgWriter(q.id+1, qq)
	wrongID.addr(qq.name, typeA, 60, netip.MustParseAddr("203.0.113.66"))
	wrongID.addr(qq.name, typeAAAA, 60, netip.MustParseAddr("2001:db8::66"))
	wrongName := newMsgWriter(q.id, question{"evil.example.", qq.qtype, classIN})
	wrongName.addr("evil.example.", typeA, 60, netip.MustParseAddr("203.0.113.66"))
	wrongType := newMsgWriter(q.id, question{qq.name, typeCNAME, classIN})
	wrongType.cname(qq.name, 60, "evil.example.")
	notReply := newMsgWriter(q.id, qq)
	notReply.addr(qq.name, typeA, 60, netip.MustParseAddr("203.0.113.66"))
	garbage := newMsgWriter(q.id, qq).bytes(flagQR | flagRA)
	garbage = append(garbage[:len(garbage)-2], 0xC0) // question cut short
	garbage[7] = 1                                   // ANCOUNT 1, missing
	return [][]byte{
		wrongID.bytes(flagQR | flagRA),
		wrongName.bytes(flagQR | flagRA),
		wrongType.bytes(flagQR | flagRA),
		notReply.bytes(flagRD),
		garbage,
	}
}

// msgWriter builds a reply with name compression: every name written is
// remembered, suffixes included, and later names point at the longest
// suffix already written.
type msgWriter struct {
	b                []byte
	names            map[string]int
	ancount, nscount uint16
	addrs            int
}

func newMsgWriter(id uint16, q question) *msgWriter {
	w := &msgWriter{b: make([]byte, headerLen), names: map[string]int{}}
	binary.BigEndian.PutUint16(w.b, id)
	binary.BigEndian.PutUint16(w.b[4:], 1)
	w.name(q.name)
	w.b = binary.BigEndian.AppendUint16(w.b, q.qtype)
	w.b = binary.BigEndian.AppendUint16(w.b, q.qclass)
	return w
}

func (w *msgWriter) name(name string) {
	for name != "." && name != "" {
		if off, ok := w.names[name]; ok {
			w.b = binary.BigEndian.AppendUint16(w.b, 0xC000|uint16(off))
			return
		}
		if len(w.b) < 0x3FFF {
			w.names[name] = len(w.b)
		}
		label, rest, _ := strings.Cut(name, ".")
		w.b = append(w.b, byte(len(label)))
		w.b = append(w.b, label...)
		name = rest
	}
	w.b = append(w.b, 0)
}

// rr writes a record's owner, type, class and TTL, then rdata (which may
// write names), then fixes RDLENGTH.
func (w *msgWriter) rr(name string, rtype uint16, ttl uint32, rdata func()) {
	w.name(name)
	w.b = binary.BigEndian.AppendUint16(w.b, rtype)
	w.b = binary.BigEndian.AppendUint16(w.b, classIN)
	w.b = binary.BigEndian.AppendUint32(w.b, ttl)
	at := len(w.b)
	w.b = append(w.b, 0, 0)
	rdata()
	binary.BigEndian.PutUint16(w.b[at:], uint16(len(w.b)-at-2))
}

func (w *msgWriter) addr(name string, rtype uint16, ttl uint32, a netip.Addr) {
	w.ancount++
	w.addrs++
	w.rr(name, rtype, ttl, func() { w.b = append(w.b, a.AsSlice()...) })
}

func (w *msgWriter) cname(name string, ttl uint32, target string) {
	w.ancount++
	w.rr(name, typeCNAME, ttl, func() { w.name(target) })
}

func (w *msgWriter) soa(ttl, minimum uint32) {
	w.nscount++
	w.rr("example.", typeSOA, ttl, func() {
		w.name("ns.example.")
		w.name("hostmaster.example.")
		for _, v := range []uint32{2024010101, 7200, 3600, 1209600, minimum} {
			w.b = binary.BigEndian.AppendUint32(w.b, v)
		}
	})
}

func (w *msgWriter) bytes(flags uint16) []byte {
	binary.BigEndian.PutUint16(w.b[2:], flags)
	binary.BigEndian.PutUint16(w.b[6:], w.ancount)
	binary.BigEndian.PutUint16(w.b[8:], w.nscount)
	return w.b
}

// closedPort returns a loopback UDP address nobody listens on: a query
// there gets ICMP port unreachable, read as "connection refused".
func closedPort(t *testing.T) string {
	t.Helper()
	c, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := c.LocalAddr().String()
	c.Close()
	return addr
}
