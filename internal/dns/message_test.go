package dns

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"reflect"
	"slices"
	"testing"

	"golang.org/x/net/dns/dnsmessage"
)

// Short names for the tables.
const (
	typeA     = dnsmessage.TypeA
	typeAAAA  = dnsmessage.TypeAAAA
	typeCNAME = dnsmessage.TypeCNAME
	typeSOA   = dnsmessage.TypeSOA
	typeMX    = dnsmessage.TypeMX
	typeTXT   = dnsmessage.TypeTXT
	classIN   = dnsmessage.ClassINET
	classCH   = dnsmessage.ClassCHAOS
)

// Builders for hand-made messages, malformed ones included: dnsmessage
// cannot write those, and bytes written here do not share its bugs.

// Header flags (RFC 1035 §4.1.1).
const (
	flagQR uint16 = 1 << 15
	flagAA uint16 = 1 << 10
	flagTC uint16 = 1 << 9
	flagRD uint16 = 1 << 8
	flagRA uint16 = 1 << 7
	// resp is a recursive resolver's reply.
	resp = flagQR | flagRD | flagRA
)

func header(id, flags, qd, an, ns, ar uint16) []byte {
	var b []byte
	for _, v := range []uint16{id, flags, qd, an, ns, ar} {
		b = binary.BigEndian.AppendUint16(b, v)
	}
	return b
}

// wire encodes a name without compression: wire("www", "example").
func wire(labels ...string) []byte {
	var b []byte
	for _, l := range labels {
		b = append(b, byte(len(l)))
		b = append(b, l...)
	}
	return append(b, 0)
}

func ptr(off int) []byte { return []byte{0xC0 | byte(off>>8), byte(off)} }

func q(name []byte, qtype dnsmessage.Type) []byte {
	return append(bytes.Clone(name), byte(qtype>>8), byte(qtype), 0, 1)
}

func rr(name []byte, rtype dnsmessage.Type, class dnsmessage.Class, ttl uint32, rdata []byte) []byte {
	b := bytes.Clone(name)
	b = binary.BigEndian.AppendUint16(b, uint16(rtype))
	b = binary.BigEndian.AppendUint16(b, uint16(class))
	b = binary.BigEndian.AppendUint32(b, ttl)
	b = binary.BigEndian.AppendUint16(b, uint16(len(rdata)))
	return append(b, rdata...)
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

func u32s(vs ...uint32) []byte {
	var b []byte
	for _, v := range vs {
		b = binary.BigEndian.AppendUint32(b, v)
	}
	return b
}

var (
	v4 = []byte{192, 0, 2, 1}
	v6 = netip.MustParseAddr("2001:db8::1").AsSlice()
)

// qWWW is the question www.example. of qtype, at offset 12, 17 bytes.
func qWWW(qtype dnsmessage.Type) []byte { return q(wire("www", "example"), qtype) }

// queryBytes is the query the resolver sends for www.example.: RD only,
// one question, and an EDNS(0) OPT record (root owner, type 41, CLASS the
// 1232-byte UDP payload size, TTL 0: extended RCODE, version 0, no flags;
// no options).
func queryBytes(id uint16, qtype dnsmessage.Type) []byte {
	return cat(header(id, flagRD, 1, 0, 0, 1), qWWW(qtype), []byte{0, 0, 41, 0x04, 0xD0, 0, 0, 0, 0, 0, 0})
}

func TestAppendQuery(t *testing.T) {
	got, err := appendQuery(nil, 0x1234, "www.example.", typeAAAA)
	if want := queryBytes(0x1234, typeAAAA); err != nil || !bytes.Equal(got, want) {
		t.Errorf("query\n% x, %v\nwant\n% x", got, err, want)
	}
	// TCP puts a length in front: the query follows it unchanged.
	got, err = appendQuery([]byte{0, 0}, 0x1234, "www.example.", typeA)
	if want := cat([]byte{0, 0}, queryBytes(0x1234, typeA)); err != nil || !bytes.Equal(got, want) {
		t.Errorf("query after a prefix\n% x, %v\nwant\n% x", got, err, want)
	}
}

func TestNameString(t *testing.T) {
	tests := []struct{ in, want string }{
		{"WWW.Example.", "www.example."},
		{".", "."},
		// Only ASCII letters fold; other bytes stay as they are, so that
		// names that differ in them stay different.
		{"\xff.example.", "\xff.example."},
		{"\xfe.example.", "\xfe.example."},
		{"\xc3\x89.example.", "\xc3\x89.example."}, // "É", not folded to "é"
		{"a\x00\x7f Z.example.", "a\x00\x7f z.example."},
	}
	for _, tt := range tests {
		if got := nameString(dnsmessage.MustNewName(tt.in)); got != tt.want {
			t.Errorf("nameString(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestCheckReply(t *testing.T) {
	ok := func() *message {
		return &message{id: 7, response: true, questions: []question{{"www.example.", typeA, classIN}}}
	}
	mod := func(f func(*message)) *message { m := ok(); f(m); return m }
	tests := []struct {
		name string
		m    *message
		want error
	}{
		{"match", ok(), nil},
		{"a query", mod(func(m *message) { m.response = false }), errNotResponse},
		{"other ID", mod(func(m *message) { m.id = 8 }), errIDMismatch},
		{"other name", mod(func(m *message) { m.questions[0].name = "www.example.net." }), errQuestionMismatch},
		{"other type", mod(func(m *message) { m.questions[0].qtype = typeAAAA }), errQuestionMismatch},
		{"other class", mod(func(m *message) { m.questions[0].qclass = dnsmessage.ClassCHAOS }), errQuestionMismatch},
		{"no question", mod(func(m *message) { m.questions = nil }), errQuestionMismatch},
		{"two questions", mod(func(m *message) { m.questions = append(m.questions, m.questions[0]) }), errQuestionMismatch},
	}
	for _, tt := range tests {
		if err := checkReply(tt.m, 7, "www.example.", typeA); err != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, err, tt.want)
		}
	}
}

func TestAnswer(t *testing.T) {
	a := func(name string, ttl uint32, ip string) record {
		addr := netip.MustParseAddr(ip)
		rtype := typeA
		if addr.Is6() {
			rtype = typeAAAA
		}
		return record{name: name, rtype: rtype, class: classIN, ttl: ttl, addr: addr}
	}
	cname := func(name string, ttl uint32, target string) record {
		return record{name: name, rtype: typeCNAME, class: classIN, ttl: ttl, target: target}
	}
	soa := record{name: "example.", rtype: typeSOA, class: classIN, ttl: 600, soaMinimum: 60}
	tests := []struct {
		name  string
		m     message
		qtype dnsmessage.Type
		want  result
		err   error
	}{
		{
			name:  "addresses, smallest TTL",
			m:     message{recursionAvail: true, answers: []record{a("www.example.", 300, "192.0.2.1"), a("www.example.", 200, "192.0.2.2")}},
			qtype: typeA,
			want:  result{addrs: addrs("192.0.2.1", "192.0.2.2"), ttl: 200},
		},
		{
			name: "chain in any order, CNAME TTLs count",
			m: message{recursionAvail: true, answers: []record{
				a("c.example.", 300, "192.0.2.1"),
				cname("b.example.", 20, "c.example."),
				cname("www.example.", 100, "b.example."),
			}},
			qtype: typeA,
			want:  result{addrs: addrs("192.0.2.1"), ttl: 20},
		},
		{
			name: "records off the chain and of other types ignored",
			m: message{recursionAvail: true, answers: []record{
				cname("www.example.", 100, "c.example."),
				a("www.example.", 1, "192.0.2.9"), // beside a CNAME: not used
				a("other.example.", 1, "192.0.2.8"),
				a("c.example.", 2, "2001:db8::1"),
				{name: "c.example.", rtype: typeA, class: 3, ttl: 1},
				a("c.example.", 300, "192.0.2.1"),
			}},
			qtype: typeA,
			want:  result{addrs: addrs("192.0.2.1"), ttl: 100},
		},
		{
			name:  "NODATA with SOA",
			m:     message{recursionAvail: true, authority: []record{soa}},
			qtype: typeA,
			want:  result{ttl: 60, cacheable: true},
		},
		{
			name:  "NODATA without SOA",
			m:     message{recursionAvail: true},
			qtype: typeA,
			want:  result{ttl: math.MaxUint32},
		},
		{
			name:  "NXDOMAIN after a CNAME, addresses ignored",
			m:     message{rcode: dnsmessage.RCodeNameError, authoritative: true, answers: []record{cname("www.example.", 30, "gone.example."), a("gone.example.", 1, "192.0.2.1")}, authority: []record{soa}},
			qtype: typeA,
			want:  result{ttl: 30, cacheable: true, nxdomain: true},
		},
		{
			name:  "CNAME loop",
			m:     message{recursionAvail: true, answers: []record{cname("www.example.", 1, "b.example."), cname("b.example.", 1, "www.example.")}},
			qtype: typeA,
			err:   errCNAMELoop,
		},
		{
			name:  "CNAME to itself",
			m:     message{recursionAvail: true, answers: []record{cname("www.example.", 1, "www.example.")}},
			qtype: typeA,
			err:   errCNAMELoop,
		},
		{
			name:  "lame referral",
			m:     message{authority: []record{{name: "example.", rtype: dnsmessage.TypeNS, class: classIN}}},
			qtype: typeA,
			err:   errLameReferral,
		},
		{
			name:  "addresses without RA or AA are used",
			m:     message{answers: []record{a("www.example.", 300, "2001:db8::1")}},
			qtype: typeAAAA,
			want:  result{addrs: addrs("2001:db8::1"), ttl: 300},
		},
		{name: "SERVFAIL", m: message{rcode: dnsmessage.RCodeServerFailure}, qtype: typeA, err: rcodeError(dnsmessage.RCodeServerFailure)},
		{name: "REFUSED", m: message{rcode: dnsmessage.RCodeRefused}, qtype: typeA, err: rcodeError(dnsmessage.RCodeRefused)},
		{name: "FORMERR", m: message{rcode: dnsmessage.RCodeFormatError}, qtype: typeA, err: rcodeError(dnsmessage.RCodeFormatError)},
	}
	for _, tt := range tests {
		got, err := answer(&tt.m, "www.example.", tt.qtype)
		if err != tt.err || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: got %+v, %v; want %+v, %v", tt.name, got, err, tt.want, tt.err)
		}
	}
}

// FuzzReply feeds the answer handling - parse, match to the query, read the
// answer - any bytes as the reply to the query 0xBEEF for www.example. A or
// AAAA. It must never panic or hang, every rejection must say which kind it
// is, and an answer must hold only what the reply's records say.
func FuzzReply(f *testing.F) {
	const id = 0xBEEF
	for _, tt := range rejected {
		f.Add(tt.reply(id), false)
	}
	for _, tt := range readable {
		f.Add(tt.udp(id), tt.qtype == typeAAAA)
	}
	for _, cfg := range []serverConfig{good, goodNoSOA, {records: zone, lame: true}, {truncateUDP: true}} {
		s := &testServer{serverConfig: cfg}
		for _, name := range []string{"www.example.", "alias.example.", "nope.example.", "mx-only.example.", "loop1.example."} {
			for _, qtype := range []dnsmessage.Type{typeA, typeAAAA} {
				f.Add(s.reply(query{id, dnsmessage.Question{Name: dnsmessage.MustNewName(name), Type: qtype, Class: classIN}}, false), qtype == typeAAAA)
			}
		}
	}
	f.Fuzz(func(t *testing.T, msg []byte, aaaa bool) {
		qtype := typeA
		if aaaa {
			qtype = typeAAAA
		}
		m, err := readReply(msg, id, "www.example.", qtype)
		if err != nil {
			if !errors.Is(err, errMalformed) && !errors.Is(err, errNotResponse) &&
				!errors.Is(err, errIDMismatch) && !errors.Is(err, errQuestionMismatch) {
				t.Fatalf("rejected as %v: not a kind of rejection", err)
			}
			return
		}
		if m.truncated {
			return // asked again over TCP
		}
		res, err := answer(m, "www.example.", qtype)
		if err != nil {
			if _, ok := errors.AsType[rcodeError](err); !ok && err != errCNAMELoop && err != errLameReferral {
				t.Fatalf("answer failed with %v: not a kind of failure", err)
			}
			return
		}
		if len(res.addrs) > 0 && (res.nxdomain || res.cacheable) {
			t.Fatalf("addresses in a negative answer: %+v", res)
		}
		if (len(res.addrs) > 0 || res.cacheable) && res.ttl > math.MaxInt32 {
			t.Fatalf("TTL %d: the top bit must read as 0", res.ttl)
		}
		// Every address is the data of an answer record of the type
		// asked, class IN, with a TTL no smaller than the answer's.
		for _, a := range res.addrs {
			if a.Is4() != (qtype == typeA) || a.Zone() != "" {
				t.Fatalf("%v in the answer to %v", a, qtype)
			}
			i := slices.IndexFunc(m.answers, func(r record) bool {
				return r.rtype == qtype && r.class == classIN && r.addr == a && r.ttl >= res.ttl
			})
			if i < 0 {
				t.Fatalf("%v is in no %v record of the reply with TTL ≥ %d", a, qtype, res.ttl)
			}
		}
	})
}
