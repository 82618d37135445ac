package dns

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

// Builders for hand-made messages.

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

func q(name []byte, qtype uint16) []byte {
	return append(bytes.Clone(name), byte(qtype>>8), byte(qtype), 0, 1)
}

func rr(name []byte, rtype, class uint16, ttl uint32, rdata []byte) []byte {
	b := bytes.Clone(name)
	b = binary.BigEndian.AppendUint16(b, rtype)
	b = binary.BigEndian.AppendUint16(b, class)
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

const resp = flagQR | flagRD | flagRA

var (
	v4   = []byte{192, 0, 2, 1}
	v6   = netip.MustParseAddr("2001:db8::1").AsSlice()
	qWWW = q(wire("www", "example"), typeA) // at offset 12, 17 bytes
)

func TestParseMessage(t *testing.T) {
	tests := []struct {
		name    string
		msg     []byte
		want    *message
		wantErr error
	}{
		{
			name: "A answer, owner compressed to the question",
			msg:  cat(header(0xBEEF, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeA, classIN, 300, v4)),
			want: &message{
				id: 0xBEEF, response: true, recursionAvail: true,
				questions: []question{{"www.example.", typeA, classIN}},
				answers:   []record{{name: "www.example.", rtype: typeA, class: classIN, ttl: 300, addr: netip.MustParseAddr("192.0.2.1")}},
			},
		},
		{
			name: "AAAA, upper case folded, flags",
			msg:  cat(header(1, flagQR|flagAA|rcodeNXDomain, 1, 1, 0, 0), q(wire("WWW", "Example"), typeAAAA), rr(wire("wWw", "EXAMPLE"), typeAAAA, classIN, 7, v6)),
			want: &message{
				id: 1, response: true, authoritative: true, rcode: rcodeNXDomain,
				questions: []question{{"www.example.", typeAAAA, classIN}},
				answers:   []record{{name: "www.example.", rtype: typeAAAA, class: classIN, ttl: 7, addr: netip.MustParseAddr("2001:db8::1")}},
			},
		},
		{
			name: "CNAME target: label then pointer to a suffix",
			// "cdn" + pointer to "example." at 16 (12 + len("\x03www"))
			msg: cat(header(2, resp, 1, 2, 0, 0), qWWW,
				rr(ptr(12), typeCNAME, classIN, 60, cat([]byte("\x03cdn"), ptr(16))),
				rr(ptr(41), typeA, classIN, 30, v4)), // 41: the CNAME's rdata
			want: &message{
				id: 2, response: true, recursionAvail: true,
				questions: []question{{"www.example.", typeA, classIN}},
				answers: []record{
					{name: "www.example.", rtype: typeCNAME, class: classIN, ttl: 60, target: "cdn.example."},
					{name: "cdn.example.", rtype: typeA, class: classIN, ttl: 30, addr: netip.MustParseAddr("192.0.2.1")},
				},
			},
		},
		{
			name: "pointer to a pointer",
			msg: cat(header(3, resp, 1, 2, 0, 0), qWWW,
				rr(ptr(12), typeA, classIN, 1, v4), // owner pointer at 29
				rr(ptr(29), typeA, classIN, 2, v4)),
			want: &message{
				id: 3, response: true, recursionAvail: true,
				questions: []question{{"www.example.", typeA, classIN}},
				answers: []record{
					{name: "www.example.", rtype: typeA, class: classIN, ttl: 1, addr: netip.MustParseAddr("192.0.2.1")},
					{name: "www.example.", rtype: typeA, class: classIN, ttl: 2, addr: netip.MustParseAddr("192.0.2.1")},
				},
			},
		},
		{
			name: "other types and classes skipped, TTL with the top bit read as 0, SOA in authority",
			msg: cat(header(4, resp, 1, 3, 1, 1), qWWW,
				rr(ptr(12), 16 /* TXT */, classIN, 5, []byte("\x05hello")),
				rr(ptr(12), typeA, 3 /* CH */, 5, []byte{1, 2, 3}),
				rr(ptr(12), typeA, classIN, 0x80000000, v4),
				rr(wire("example"), typeSOA, classIN, 900, cat(wire("ns"), ptr(16), u32s(1, 2, 3, 4, 120))),
				[]byte("additional section: never read")),
			want: &message{
				id: 4, response: true, recursionAvail: true,
				questions: []question{{"www.example.", typeA, classIN}},
				answers: []record{
					{name: "www.example.", rtype: 16, class: classIN, ttl: 5},
					{name: "www.example.", rtype: typeA, class: 3, ttl: 5},
					{name: "www.example.", rtype: typeA, class: classIN, ttl: 0, addr: netip.MustParseAddr("192.0.2.1")},
				},
				authority: []record{{name: "example.", rtype: typeSOA, class: classIN, ttl: 900, soaMinimum: 120}},
			},
		},
		{
			name: "truncated: records not parsed",
			msg:  cat(header(5, resp|flagTC, 1, 9, 9, 0), qWWW, []byte{0xFF}),
			want: &message{
				id: 5, response: true, truncated: true, recursionAvail: true,
				questions: []question{{"www.example.", typeA, classIN}},
			},
		},
		{
			name: "odd bytes in labels escaped",
			msg:  cat(header(6, resp, 1, 0, 0, 0), q(wire("a.b", "c\\d", "\x00\x7f Z"), typeA)),
			want: &message{
				id: 6, response: true, recursionAvail: true,
				questions: []question{{`a\.b.c\\d.\000\127\032z.`, typeA, classIN}},
			},
		},
		{
			name: "root name",
			msg:  cat(header(7, resp, 1, 0, 0, 0), q(wire(), typeA)),
			want: &message{
				id: 7, response: true, recursionAvail: true,
				questions: []question{{".", typeA, classIN}},
			},
		},
		{name: "empty", msg: nil, wantErr: errShortMessage},
		{name: "short header", msg: header(1, resp, 0, 0, 0, 0)[:11], wantErr: errShortMessage},
		{name: "missing question", msg: header(1, resp, 1, 0, 0, 0), wantErr: errShortMessage},
		{name: "question cut in its name", msg: cat(header(1, resp, 1, 0, 0, 0), []byte("\x03ww")), wantErr: errShortMessage},
		{name: "question without type", msg: cat(header(1, resp, 1, 0, 0, 0), wire("www"), []byte{0, 1}), wantErr: errShortMessage},
		{name: "missing answer", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW), wantErr: errShortMessage},
		{name: "missing authority", msg: cat(header(1, resp, 1, 0, 1, 0), qWWW), wantErr: errShortMessage},
		{name: "answer cut in its fixed part", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeA, classIN, 1, v4)[:8]), wantErr: errShortMessage},
		{name: "rdata past the end", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeA, classIN, 1, v4)[:14]), wantErr: errShortMessage},
		{name: "A with 5 bytes", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeA, classIN, 1, []byte{1, 2, 3, 4, 5})), wantErr: errRDataLength},
		{name: "AAAA with 4 bytes", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeAAAA, classIN, 1, v4)), wantErr: errRDataLength},
		{name: "CNAME with bytes after the name", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeCNAME, classIN, 1, cat(ptr(12), []byte{0}))), wantErr: errRDataLength},
		{name: "CNAME name running past its rdata", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeCNAME, classIN, 1, []byte("\x03cdn")), wire("x")), wantErr: errRDataLength},
		{name: "SOA too short", msg: cat(header(1, resp, 1, 0, 1, 0), qWWW, rr(ptr(12), typeSOA, classIN, 1, cat(ptr(12), ptr(12), u32s(1, 2, 3, 4)))), wantErr: errRDataLength},
		{name: "pointer to itself", msg: cat(header(1, resp, 1, 0, 0, 0), ptr(12)), wantErr: errPointerLoop},
		{name: "two pointers pointing at each other", msg: cat(header(1, resp, 1, 0, 0, 0), ptr(14), ptr(12)), wantErr: errPointerLoop},
		{name: "short label then pointer back to it", msg: cat(header(1, resp, 1, 0, 0, 0), []byte("\x01a"), ptr(12)), wantErr: errPointerLoop},
		{name: "long label then pointer back to it", msg: cat(header(1, resp, 1, 0, 0, 0), []byte("\x05abcde"), ptr(12)), wantErr: errNameTooLong},
		{name: "loop in an answer's owner", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(cat([]byte("\x01x"), ptr(29)), typeA, classIN, 1, v4)), wantErr: errPointerLoop},
		{name: "loop in a CNAME target", msg: cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeCNAME, classIN, 1, ptr(41))), wantErr: errPointerLoop},
		{name: "pointer past the end", msg: cat(header(1, resp, 1, 0, 0, 0), ptr(400)), wantErr: errShortMessage},
		{name: "pointer cut in half", msg: cat(header(1, resp, 1, 0, 0, 0), []byte{0xC0}), wantErr: errShortMessage},
		{name: "label type 01", msg: cat(header(1, resp, 1, 0, 0, 0), []byte{0x41, 0}), wantErr: errLabelType},
		{name: "label type 10", msg: cat(header(1, resp, 1, 0, 0, 0), []byte{0x80, 0}), wantErr: errLabelType},
		{name: "name of 256 octets", msg: cat(header(1, resp, 1, 0, 0, 0), q(wire(strings.Repeat("a", 63), strings.Repeat("b", 63), strings.Repeat("c", 63), strings.Repeat("d", 62)), typeA)), wantErr: errNameTooLong},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseMessage(tt.msg)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("error %v, want %v", err, tt.wantErr)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestReadNameLongest(t *testing.T) {
	// 255 octets: 63+1, 63+1, 63+1, 61+1, root.
	labels := []string{strings.Repeat("a", 63), strings.Repeat("b", 63), strings.Repeat("c", 63), strings.Repeat("d", 61)}
	name, end, err := readName(wire(labels...), 0)
	if want := strings.Join(labels, ".") + "."; err != nil || name != want || end != 255 {
		t.Errorf("readName = %q, %d, %v", name, end, err)
	}
}

func TestAppendQuery(t *testing.T) {
	b := appendQuery(nil, 0x1234, "www.example.", typeAAAA)
	want := cat(header(0x1234, flagRD, 1, 0, 0, 1), q(wire("www", "example"), typeAAAA),
		[]byte{0, 0, 41, 0x04, 0xD0, 0, 0, 0, 0, 0, 0})
	if !bytes.Equal(b, want) {
		t.Errorf("query\n% x\nwant\n% x", b, want)
	}
	m, err := parseMessage(b)
	if err != nil || m.id != 0x1234 || m.response || len(m.questions) != 1 || m.questions[0] != (question{"www.example.", typeAAAA, classIN}) {
		t.Errorf("parsed back: %+v, %v", m, err)
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
		{"other class", mod(func(m *message) { m.questions[0].qclass = 3 }), errQuestionMismatch},
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
		qtype uint16
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
			m:     message{rcode: rcodeNXDomain, authoritative: true, answers: []record{cname("www.example.", 30, "gone.example."), a("gone.example.", 1, "192.0.2.1")}, authority: []record{soa}},
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
			m:     message{authority: []record{{name: "example.", rtype: 2 /* NS */, class: classIN}}},
			qtype: typeA,
			err:   errLameReferral,
		},
		{
			name:  "addresses without RA or AA are used",
			m:     message{answers: []record{a("www.example.", 300, "2001:db8::1")}},
			qtype: typeAAAA,
			want:  result{addrs: addrs("2001:db8::1"), ttl: 300},
		},
		{name: "SERVFAIL", m: message{rcode: rcodeServFail}, qtype: typeA, err: rcodeError(rcodeServFail)},
		{name: "REFUSED", m: message{rcode: rcodeRefused}, qtype: typeA, err: rcodeError(rcodeRefused)},
		{name: "FORMERR", m: message{rcode: rcodeFormErr}, qtype: typeA, err: rcodeError(rcodeFormErr)},
	}
	for _, tt := range tests {
		got, err := answer(&tt.m, "www.example.", tt.qtype)
		if err != tt.err || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: got %+v, %v; want %+v, %v", tt.name, got, err, tt.want, tt.err)
		}
	}
}

func FuzzParseMessage(f *testing.F) {
	f.Add(cat(header(1, resp, 1, 1, 0, 0), qWWW, rr(ptr(12), typeA, classIN, 300, v4)))
	f.Add(cat(header(2, resp, 1, 2, 1, 0), qWWW,
		rr(ptr(12), typeCNAME, classIN, 60, cat([]byte("\x03cdn"), ptr(16))),
		rr(ptr(41), typeAAAA, classIN, 30, v6),
		rr(wire("example"), typeSOA, classIN, 900, cat(wire("ns"), ptr(16), u32s(1, 2, 3, 4, 120)))))
	f.Add(cat(header(3, resp|flagTC, 1, 0, 0, 0), qWWW))
	f.Add(cat(header(4, resp, 1, 0, 0, 0), ptr(12)))
	f.Add(cat(header(5, resp|rcodeNXDomain, 1, 0, 0, 0), qWWW))
	f.Add(appendQuery(nil, 6, "www.example.", typeAAAA))
	f.Fuzz(func(t *testing.T, msg []byte) {
		m, err := parseMessage(msg)
		if err != nil {
			return
		}
		for _, q := range m.questions {
			if len(q.name) > 4*maxNameLen { // "\DDD" per octet at most
				t.Fatalf("question name of %d bytes", len(q.name))
			}
			_, _ = answer(m, q.name, q.qtype)
			_ = checkReply(m, m.id, q.name, q.qtype)
		}
	})
}
