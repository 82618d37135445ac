package dns

import (
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// testRR is a record a testServer answers from.
type testRR struct {
	name  string // lower case, trailing dot
	rtype dnsmessage.Type
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
	rcode dnsmessage.RCode
	// servfail, when set, is the type of the questions answered SERVFAIL;
	// drop, that of the questions not answered.
	servfail, drop dnsmessage.Type
	// lame replies without RA (and without AA).
	lame bool
	// truncateUDP replies over UDP with TC set and no records;
	// truncateTCP does the same over TCP.
	truncateUDP, truncateTCP bool
	// forge sends, before each UDP reply, one with the wrong ID, one for
	// another question, one with QR unset and one that does not parse.
	forge bool
	// replies, when set, are sent instead of a reply from the table: over
	// UDP each in turn, over TCP the first. They answer the query id for
	// qtype.
	replies func(id uint16, qtype dnsmessage.Type, tcp bool) [][]byte
	// delay holds each reply back; silent drops every query.
	delay  time.Duration
	silent bool
}

// testServer is a DNS server on 127.0.0.1, UDP and TCP on the same port,
// answering from a table like a recursive resolver would: CNAME chains
// followed, NXDOMAIN for names it has no records for. It builds its
// replies with dnsmessage, names compressed.
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
			q, ok := s.record(buf[:n])
			if !ok || s.silent || q.Type == s.drop || !s.wait() {
				return
			}
			var replies [][]byte
			if s.forge {
				replies = forgeries(q)
			}
			if s.replies != nil {
				replies = append(replies, s.replies(q.ID, q.Type, false)...)
			} else {
				replies = append(replies, s.reply(q, false))
			}
			for _, reply := range replies {
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
				q, ok := s.record(buf)
				if !ok || s.silent || !s.wait() {
					return
				}
				var reply []byte
				if s.replies != nil {
					reply = s.replies(q.ID, q.Type, true)[0]
				} else {
					reply = s.reply(q, true)
				}
				c.Write(binary.BigEndian.AppendUint16(nil, uint16(len(reply))))
				c.Write(reply)
			}
		})
	}
}

// query is what the server reads of a query: its ID and its one question.
type query struct {
	ID uint16
	dnsmessage.Question
}

// record keeps query and reads it, with dnsmessage: the resolver's
// queries are checked byte by byte in TestLookupQueries.
func (s *testServer) record(msg []byte) (query, bool) {
	s.mu.Lock()
	s.queries = append(s.queries, append([]byte(nil), msg...))
	s.mu.Unlock()
	var p dnsmessage.Parser
	h, err := p.Start(msg)
	if err != nil {
		return query{}, false
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 {
		return query{}, false
	}
	return query{h.ID, qs[0]}, true
}

func (s *testServer) received() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.queries...)
}

// reply builds the reply to q from the table.
func (s *testServer) reply(q query, tcp bool) []byte {
	m := dnsmessage.Message{
		Header: dnsmessage.Header{
			ID: q.ID, Response: true, RecursionDesired: true, RecursionAvailable: !s.lame,
		},
		Questions: []dnsmessage.Question{q.Question},
	}
	switch {
	case s.rcode != 0:
		m.RCode = s.rcode
	case q.Type == s.servfail:
		m.RCode = dnsmessage.RCodeServerFailure
	case s.truncateUDP && !tcp, s.truncateTCP && tcp:
		m.Truncated = true
	default:
		name, known, addrs := q.Name.String(), false, 0
		for hops := 0; hops < 16; hops++ {
			target := ""
			known = false
			for _, rr := range s.records {
				if rr.name != name {
					continue
				}
				known = true
				switch rr.rtype {
				case dnsmessage.TypeCNAME:
					m.Answers = append(m.Answers, cnameRR(rr.name, rr.ttl, rr.data))
					target = rr.data
				case q.Type:
					m.Answers = append(m.Answers, addrRR(rr.name, rr.ttl, netip.MustParseAddr(rr.data)))
					addrs++
				}
			}
			if target == "" {
				break
			}
			name = target
		}
		if !known {
			m.RCode = dnsmessage.RCodeNameError
		}
		if addrs == 0 && s.soaTTL != 0 {
			m.Authorities = append(m.Authorities, soaRR(s.soaTTL, s.soaMinimum))
		}
	}
	return pack(m)
}

// forgeries are replies to q that the resolver must ignore.
func forgeries(q query) [][]byte {
	evil := netip.MustParseAddr("203.0.113.66")
	if q.Type == dnsmessage.TypeAAAA {
		evil = netip.MustParseAddr("2001:db8::66")
	}
	h := dnsmessage.Header{ID: q.ID, Response: true, RecursionAvailable: true}
	wrongID := h
	wrongID.ID++
	evilQ := q.Question
	evilQ.Name = dnsmessage.MustNewName("evil.example.")
	cnameQ := q.Question
	cnameQ.Type = dnsmessage.TypeCNAME
	notReply := h
	notReply.Response = false
	good := dnsmessage.Message{Header: h, Questions: []dnsmessage.Question{q.Question}}
	garbage := pack(good)
	garbage = append(garbage[:len(garbage)-2], 0xC0) // question cut short
	garbage[7] = 1                                   // ANCOUNT 1, missing
	return [][]byte{
		pack(dnsmessage.Message{Header: wrongID, Questions: []dnsmessage.Question{q.Question}, Answers: []dnsmessage.Resource{addrRR(q.Name.String(), 60, evil)}}),
		pack(dnsmessage.Message{Header: h, Questions: []dnsmessage.Question{evilQ}, Answers: []dnsmessage.Resource{addrRR("evil.example.", 60, evil)}}),
		pack(dnsmessage.Message{Header: h, Questions: []dnsmessage.Question{cnameQ}, Answers: []dnsmessage.Resource{cnameRR(q.Name.String(), 60, "evil.example.")}}),
		pack(dnsmessage.Message{Header: notReply, Questions: []dnsmessage.Question{q.Question}, Answers: []dnsmessage.Resource{addrRR(q.Name.String(), 60, evil)}}),
		garbage,
	}
}

func pack(m dnsmessage.Message) []byte {
	b, err := m.Pack()
	if err != nil {
		panic("pack reply: " + err.Error())
	}
	return b
}

func rrHeader(name string, ttl uint32) dnsmessage.ResourceHeader {
	return dnsmessage.ResourceHeader{Name: dnsmessage.MustNewName(name), Class: dnsmessage.ClassINET, TTL: ttl}
}

func addrRR(name string, ttl uint32, a netip.Addr) dnsmessage.Resource {
	if a.Is4() {
		return dnsmessage.Resource{Header: rrHeader(name, ttl), Body: &dnsmessage.AResource{A: a.As4()}}
	}
	return dnsmessage.Resource{Header: rrHeader(name, ttl), Body: &dnsmessage.AAAAResource{AAAA: a.As16()}}
}

func cnameRR(name string, ttl uint32, target string) dnsmessage.Resource {
	return dnsmessage.Resource{Header: rrHeader(name, ttl), Body: &dnsmessage.CNAMEResource{CNAME: dnsmessage.MustNewName(target)}}
}

func soaRR(ttl, minimum uint32) dnsmessage.Resource {
	return dnsmessage.Resource{Header: rrHeader("example.", ttl), Body: &dnsmessage.SOAResource{
		NS: dnsmessage.MustNewName("ns.example."), MBox: dnsmessage.MustNewName("hostmaster.example."),
		Serial: 2024010101, Refresh: 7200, Retry: 3600, Expire: 1209600, MinTTL: minimum,
	}}
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
