package dns

import (
	"cmp"
	"errors"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// What the resolver makes of one server's replies, sent byte for byte: a
// reply is built by hand, sent over UDP (and TCP when the UDP one is
// truncated), and the resolver's exchange with the server reads it.

var evil = []byte{203, 0, 113, 66} // an address a rejected reply carries

// goodReply is the reply to query id for www.example. A: 192.0.2.1, TTL 300.
func goodReply(id uint16) []byte {
	return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 300, v4))
}

// startRawServer starts a server that answers query id with udp(id) over
// UDP, each message in turn, and with tcp(id) over TCP; a nil tcp means
// that no TCP query is expected.
func startRawServer(t *testing.T, udp func(id uint16) [][]byte, tcp func(id uint16) []byte) *testServer {
	t.Helper()
	return startServer(t, serverConfig{replies: func(id uint16, _ dnsmessage.Type, overTCP bool) [][]byte {
		if !overTCP {
			return udp(id)
		}
		if tcp == nil {
			t.Errorf("unexpected TCP query")
			return [][]byte{nil}
		}
		return [][]byte{tcp(id)}
	}})
}

// readable are replies the resolver reads, sent for the query id for
// www.example. of qtype (A unless set) over UDP.
var readable = []struct {
	name  string
	qtype dnsmessage.Type
	udp   func(id uint16) []byte
	// tcp, when set, is the reply over TCP, asked tcpQueries times.
	tcp        func(id uint16) []byte
	tcpQueries int32
	want       result
}{
	{
		name: "owner compressed to the question",
		udp:  goodReply,
		want: result{addrs: addrs("192.0.2.1"), ttl: 300},
	},
	{
		name:  "upper case in question and owner, AA without RA",
		qtype: typeAAAA,
		udp: func(id uint16) []byte {
			return cat(header(id, flagQR|flagAA, 1, 1, 0, 0), q(wire("WWW", "Example"), typeAAAA), rr(wire("wWw", "EXAMPLE"), typeAAAA, classIN, 7, v6))
		},
		want: result{addrs: addrs("2001:db8::1"), ttl: 7},
	},
	{
		name: "CNAME target: label then pointer to a suffix",
		udp: func(id uint16) []byte {
			// "cdn" + pointer to "example." at 16 (12 + len("\x03www"));
			// the A record's owner points at the CNAME's data, at 41.
			return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA),
				rr(ptr(12), typeCNAME, classIN, 60, cat([]byte("\x03cdn"), ptr(16))),
				rr(ptr(41), typeA, classIN, 30, v4))
		},
		want: result{addrs: addrs("192.0.2.1"), ttl: 30},
	},
	{
		name: "pointer to a pointer",
		udp: func(id uint16) []byte {
			return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA),
				rr(ptr(12), typeA, classIN, 2, v4), // owner pointer at 29
				rr(ptr(29), typeA, classIN, 1, v4))
		},
		want: result{addrs: addrs("192.0.2.1", "192.0.2.1"), ttl: 1}, // Lookup removes duplicates
	},
	{
		name: "CNAME chain in any order, CNAME TTLs count",
		udp: func(id uint16) []byte {
			return cat(header(id, resp, 1, 3, 0, 0), qWWW(typeA),
				rr(wire("c", "example"), typeA, classIN, 300, v4),
				rr(wire("b", "example"), typeCNAME, classIN, 20, wire("c", "example")),
				rr(ptr(12), typeCNAME, classIN, 100, wire("b", "example")))
		},
		want: result{addrs: addrs("192.0.2.1"), ttl: 20},
	},
	{
		name: "other types and classes skipped, TTL with the top bit read as 0, additional section never read",
		udp: func(id uint16) []byte {
			return cat(header(id, resp, 1, 3, 1, 1), qWWW(typeA),
				rr(ptr(12), typeTXT, classIN, 5, []byte("\x05hello")),
				rr(ptr(12), typeA, classCH, 5, []byte{1, 2, 3}),
				rr(ptr(12), typeA, classIN, 0x80000000, v4),
				soaRecord,
				[]byte("additional section: never read"))
		},
		want: result{addrs: addrs("192.0.2.1"), ttl: 0},
	},
	{
		name: "names with odd bytes compare exactly, ASCII letters folded",
		udp: func(id uint16) []byte {
			return cat(header(id, resp, 1, 3, 0, 0), qWWW(typeA),
				rr(ptr(12), typeCNAME, classIN, 60, wire("\xff\x00 Z", "example")),
				rr(wire("\xfe\x00 z", "example"), typeA, classIN, 60, evil),
				rr(wire("\xff\x00 z", "example"), typeA, classIN, 60, v4))
		},
		want: result{addrs: addrs("192.0.2.1"), ttl: 60},
	},
	{
		name: "NXDOMAIN: negative TTL from the SOA",
		udp: func(id uint16) []byte {
			return cat(header(id, resp|uint16(dnsmessage.RCodeNameError), 1, 0, 1, 0), qWWW(typeA), soaRecord)
		},
		want: result{ttl: 120, cacheable: true, nxdomain: true},
	},
	{
		// The hand parser refused this; dnsmessage, like Go's resolver,
		// reads a name in record data without checking it against
		// RDLENGTH (nor RDLENGTH against the message, for the last
		// record), and the next record starts where RDLENGTH says.
		name: "CNAME data longer than its name",
		udp: func(id uint16) []byte {
			return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA),
				rr(ptr(12), typeCNAME, classIN, 60, cat(wire("cdn", "example"), []byte{0xDE, 0xAD})),
				rr(wire("cdn", "example"), typeA, classIN, 30, v4))
		},
		want: result{addrs: addrs("192.0.2.1"), ttl: 30},
	},
	{
		name: "truncated over UDP, records not read: asked again over TCP",
		udp: func(id uint16) []byte {
			return cat(header(id, resp|flagTC, 1, 9, 9, 0), qWWW(typeA), []byte{0xFF})
		},
		tcp:        goodReply,
		tcpQueries: 1,
		want:       result{addrs: addrs("192.0.2.1"), ttl: 300},
	},
}

// soaRecord is example.'s SOA: TTL 900, MINIMUM 120.
var soaRecord = rr(wire("example"), typeSOA, classIN, 900, cat(wire("ns"), ptr(16), u32s(1, 2, 3, 4, 120)))

func TestExchangeReadsReplies(t *testing.T) {
	for _, tt := range readable {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := startRawServer(t, func(id uint16) [][]byte { return [][]byte{tt.udp(id)} }, tt.tcp)
			qtype := cmp.Or(tt.qtype, typeA)
			got, err := newResolver(t, s.addr).exchange(t.Context(), s.addr, "www.example.", qtype)
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Errorf("exchange = %+v, %v; want %+v", got, err, tt.want)
			}
			if n := s.tcpQueries.Load(); n != tt.tcpQueries {
				t.Errorf("%d TCP queries, want %d", n, tt.tcpQueries)
			}
		})
	}
}

// rejected are replies to the query id for www.example. A that the
// resolver must not use: over UDP it ignores them and waits on, over TCP
// they fail the server. err is what they are; reason, for malformed ones,
// the part of dnsmessage's error that says why.
var rejected = []struct {
	name   string
	reply  func(id uint16) []byte
	err    error
	reason string
}{
	{"empty", func(uint16) []byte { return []byte{} }, errMalformed, "insufficient data"},
	{"short header", func(id uint16) []byte { return header(id, resp, 0, 0, 0, 0)[:11] }, errMalformed, "insufficient data"},
	{"missing question", func(id uint16) []byte { return header(id, resp, 1, 0, 0, 0) }, errMalformed, "insufficient data"},
	{"question cut in its name", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte("\x03ww")) }, errMalformed, "insufficient data"},
	{"question without class", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), wire("www", "example"), []byte{0, 1}) }, errMalformed, "insufficient data"},
	{"missing answer", func(id uint16) []byte { return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA)) }, errMalformed, "insufficient data"},
	{"missing authority", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 1, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errMalformed, "insufficient data"},
	{"65535 answers announced, one sent", func(id uint16) []byte {
		return cat(header(id, resp, 1, 65535, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errMalformed, "insufficient data"},
	{"answer cut in its fixed part", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil)[:8])
	}, errMalformed, "insufficient data"},
	{"A data past the end", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil)[:14])
	}, errMalformed, "insufficient data"},
	{"skipped type's data past the end", func(id uint16) []byte {
		return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil), rr(ptr(12), typeTXT, classIN, 1, []byte("\x05hello"))[:15])
	}, errMalformed, "insufficient data for resource body length"},
	{"other class's data past the end", func(id uint16) []byte {
		return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil), rr(ptr(12), typeA, classCH, 1, v4)[:14])
	}, errMalformed, "insufficient data for resource body length"},
	{"A with 5 bytes", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, append(evil, 1)))
	}, errMalformed, "A record with 5 bytes"},
	{"A with 3 bytes", func(id uint16) []byte {
		return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil[:3]), rr(ptr(12), typeA, classIN, 1, evil))
	}, errMalformed, "A record with 3 bytes"},
	{"AAAA with 4 bytes", func(id uint16) []byte {
		return cat(header(id, resp, 1, 2, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil), rr(ptr(12), typeAAAA, classIN, 1, v4))
	}, errMalformed, "AAAA record with 4 bytes"},
	{"SOA cut short", func(id uint16) []byte {
		return cat(header(id, resp, 1, 0, 1, 0), qWWW(typeA), rr(ptr(12), typeSOA, classIN, 1, cat(ptr(12), ptr(12), u32s(1, 2, 3, 4))))
	}, errMalformed, "MinTTL"},
	{"pointer to itself", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), ptr(12)) }, errMalformed, "too many pointers"},
	{"two pointers pointing at each other", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), ptr(14), ptr(12)) }, errMalformed, "too many pointers"},
	{"short label then pointer back to it", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte("\x01a"), ptr(12)) }, errMalformed, "too many pointers"},
	{"long label then pointer back to it", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte("\x05abcde"), ptr(12)) }, errMalformed, "too many pointers"},
	{"loop in an answer's owner", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(cat([]byte("\x01x"), ptr(29)), typeA, classIN, 1, evil))
	}, errMalformed, "too many pointers"},
	{"loop in a CNAME target", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeCNAME, classIN, 1, ptr(41)))
	}, errMalformed, "too many pointers"},
	{"owner reached through 11 pointers", func(id uint16) []byte {
		// Each record's owner points at the one before: the 11th follows
		// 11 pointers to reach the question's name. No loop, but more
		// than dnsmessage follows (the hand parser followed 126).
		b := cat(header(id, resp, 1, 11, 0, 0), qWWW(typeA))
		for at := 12; len(b) < 29+11*16; {
			next := len(b)
			b = cat(b, rr(ptr(at), typeA, classIN, 1, evil))
			at = next
		}
		return b
	}, errMalformed, "too many pointers"},
	{"pointer past the end", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), ptr(400)) }, errMalformed, "insufficient data"},
	{"pointer cut in half", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte{0xC0}) }, errMalformed, "invalid pointer"},
	{"label type 01", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte{0x41, 0}) }, errMalformed, "reserved"},
	{"label type 10", func(id uint16) []byte { return cat(header(id, resp, 1, 0, 0, 0), []byte{0x80, 0}) }, errMalformed, "reserved"},
	{"name of 256 octets", func(id uint16) []byte {
		long := wire(strings.Repeat("a", 63), strings.Repeat("b", 63), strings.Repeat("c", 63), strings.Repeat("d", 62))
		return cat(header(id, resp, 1, 0, 0, 0), q(long, typeA))
	}, errMalformed, "name too long"},
	{"CNAME target of 257 octets through a pointer", func(id uint16) []byte {
		// 4 labels of 60 (244 octets) then "www.example." (13).
		l := strings.Repeat("x", 60)
		target := cat([]byte{60}, []byte(l), []byte{60}, []byte(l), []byte{60}, []byte(l), []byte{60}, []byte(l), ptr(12))
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeCNAME, classIN, 1, target))
	}, errMalformed, "name too long"},
	{"dot inside a label", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), q(wire("www.example"), typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errMalformed, "invalid dns name"},
	{"truncated, question cut", func(id uint16) []byte { return cat(header(id, resp|flagTC, 1, 0, 0, 0), qWWW(typeA)[:16]) }, errMalformed, "insufficient data"},
	{"not a response", func(id uint16) []byte {
		return cat(header(id, flagRD, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errNotResponse, ""},
	{"other ID", func(id uint16) []byte {
		return cat(header(id+1, resp, 1, 1, 0, 0), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errIDMismatch, ""},
	// Not a reason to ask over TCP (startRawServer fails on a TCP query).
	{"truncated, other ID", func(id uint16) []byte { return cat(header(id^0x8000, resp|flagTC, 1, 0, 0, 0), qWWW(typeA)) }, errIDMismatch, ""},
	{"other name", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), q(wire("evil", "example"), typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errQuestionMismatch, ""},
	{"other type", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), qWWW(typeAAAA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errQuestionMismatch, ""},
	{"other class", func(id uint16) []byte {
		return cat(header(id, resp, 1, 1, 0, 0), wire("www", "example"), []byte{0, 1, 0, 3}, rr(ptr(12), typeA, classIN, 1, evil))
	}, errQuestionMismatch, ""},
	{"no question", func(id uint16) []byte {
		return cat(header(id, resp, 0, 1, 0, 0), rr(wire("www", "example"), typeA, classIN, 1, evil))
	}, errQuestionMismatch, ""},
	{"two questions", func(id uint16) []byte {
		return cat(header(id, resp, 2, 1, 0, 0), qWWW(typeA), qWWW(typeA), rr(ptr(12), typeA, classIN, 1, evil))
	}, errQuestionMismatch, ""},
}

// TestExchangeIgnoresRejectedOverUDP: a reply that is malformed or not the
// query's may be forged, and the real one may still come.
func TestExchangeIgnoresRejectedOverUDP(t *testing.T) {
	for _, tt := range rejected {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := startRawServer(t, func(id uint16) [][]byte { return [][]byte{tt.reply(id), goodReply(id)} }, nil)
			got, err := newResolver(t, s.addr).exchange(t.Context(), s.addr, "www.example.", typeA)
			if want := (result{addrs: addrs("192.0.2.1"), ttl: 300}); err != nil || !reflect.DeepEqual(got, want) {
				t.Errorf("exchange = %+v, %v; want %+v", got, err, want)
			}
		})
	}
}

// TestExchangeReportsIgnoredReply: when no good reply comes, the timeout
// says what was ignored, and why. The exchanges run at once, so that the
// test waits one Timeout, not one per row.
func TestExchangeReportsIgnoredReply(t *testing.T) {
	errs := make([]error, len(rejected))
	var wg sync.WaitGroup
	for i, tt := range rejected {
		s := startRawServer(t, func(id uint16) [][]byte { return [][]byte{tt.reply(id)} }, nil)
		r := newResolver(t, s.addr)
		wg.Go(func() { _, errs[i] = r.exchange(t.Context(), s.addr, "www.example.", typeA) })
	}
	wg.Wait()
	for i, tt := range rejected {
		if want := "(ignored a reply: " + tt.err.Error(); !errors.Is(errs[i], os.ErrDeadlineExceeded) ||
			!strings.Contains(errs[i].Error(), want) || !strings.Contains(errs[i].Error(), tt.reason) {
			t.Errorf("%s: exchange error %v; want a timeout with %q...%q", tt.name, errs[i], want, tt.reason)
		}
	}
}

// TestExchangeFailsRejectedOverTCP: over TCP nobody can inject a reply
// without guessing sequence numbers, so the one reply is the server's.
func TestExchangeFailsRejectedOverTCP(t *testing.T) {
	truncated := func(id uint16) [][]byte { return [][]byte{cat(header(id, resp|flagTC, 1, 0, 0, 0), qWWW(typeA))} }
	for _, tt := range rejected {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := startRawServer(t, truncated, tt.reply)
			got, err := newResolver(t, s.addr).exchange(t.Context(), s.addr, "www.example.", typeA)
			if !errors.Is(err, tt.err) || !strings.Contains(err.Error(), tt.reason) || got.addrs != nil {
				t.Errorf("exchange = %+v, %v; want %v (%q)", got, err, tt.err, tt.reason)
			}
			if n := s.tcpQueries.Load(); n != 1 {
				t.Errorf("%d TCP queries, want 1", n)
			}
		})
	}
}

func TestExchangeTruncatedOverTCPToo(t *testing.T) {
	truncated := func(id uint16) []byte { return cat(header(id, resp|flagTC, 1, 0, 0, 0), qWWW(typeA)) }
	s := startRawServer(t, func(id uint16) [][]byte { return [][]byte{truncated(id)} }, truncated)
	_, err := newResolver(t, s.addr).exchange(t.Context(), s.addr, "www.example.", typeA)
	if !errors.Is(err, errTruncatedTCP) {
		t.Errorf("exchange error %v, want %v", err, errTruncatedTCP)
	}
}

// TestLookupLargeReplies: replies beyond the advertised 1232 bytes, from a
// server that ignores it, are read whole over UDP; and near the 64 KiB
// limit of a DNS message over TCP.
func TestLookupLargeReplies(t *testing.T) {
	tests := []struct {
		name   string
		n      int
		config func([]testRR) serverConfig
	}{
		{"UDP", 3500, func(rrs []testRR) serverConfig { return serverConfig{records: rrs} }},
		{"TCP after a truncated UDP reply", 3500, func(rrs []testRR) serverConfig { return serverConfig{records: rrs, truncateUDP: true} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var rrs []testRR
			var want []netip.Addr
			for i := range tt.n {
				a := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
				rrs = append(rrs, testRR{"big.example.", typeA, uint32(60 + i), a.String()})
				want = append(want, a)
			}
			s := startServer(t, tt.config(rrs))
			got, ttl, err := newResolver(t, s.addr).Lookup(t.Context(), "big.example")
			if err != nil || !slices.Equal(got, want) || ttl != time.Minute {
				t.Errorf("Lookup = %d addresses, %v, %v; want %d, 1m0s", len(got), ttl, err, len(want))
			}
			if size := len(s.reply(query{Question: dnsmessage.Question{Name: dnsmessage.MustNewName("big.example."), Type: typeA, Class: classIN}}, true)); size < 50000 {
				t.Errorf("reply of %d bytes: not large", size)
			}
		})
	}
}
