package dns

import (
	"encoding/binary"
	"math"
	"net/netip"
	"strconv"
	"strings"
)

// Record types and class (RFC 1035 §3.2.2, RFC 3596, RFC 6891).
const (
	typeA     uint16 = 1
	typeCNAME uint16 = 5
	typeSOA   uint16 = 6
	typeAAAA  uint16 = 28
	typeOPT   uint16 = 41
	classIN   uint16 = 1
)

// Response codes (RFC 1035 §4.1.1).
const (
	rcodeSuccess  = 0
	rcodeFormErr  = 1
	rcodeServFail = 2
	rcodeNXDomain = 3
	rcodeNotImp   = 4
	rcodeRefused  = 5
)

// Header flags (RFC 1035 §4.1.1).
const (
	flagQR = 1 << 15
	flagAA = 1 << 10
	flagTC = 1 << 9
	flagRD = 1 << 8
	flagRA = 1 << 7
)

const (
	headerLen   = 12
	maxNameLen  = 255 // octets on the wire, length bytes and root included
	maxLabelLen = 63
	// maxPointers bounds the compression pointers followed in one name. A
	// name has at most 127 labels and a sane message needs at most one
	// pointer per label; more can only be a loop (miekg/dns uses the same
	// bound).
	maxPointers = 126
	// udpPayloadSize is the UDP reply size advertised with EDNS(0): the
	// DNS Flag Day 2020 value, which avoids IP fragmentation.
	udpPayloadSize = 1232
)

type question struct {
	name   string // lower-case presentation form, trailing dot
	qtype  uint16
	qclass uint16
}

type record struct {
	name  string // lower-case presentation form, trailing dot
	rtype uint16
	class uint16
	ttl   uint32 // seconds; values with the top bit set read as 0 (RFC 2181 §8)

	addr       netip.Addr // A, AAAA (class IN)
	target     string     // CNAME (class IN)
	soaMinimum uint32     // SOA (class IN): the negative-caching TTL field
}

type message struct {
	id             uint16
	response       bool
	authoritative  bool
	truncated      bool
	recursionAvail bool
	rcode          int
	questions      []question
	// answers and authority are not parsed when truncated is set: a
	// truncated message is only used to decide to retry over TCP. The
	// additional section is never parsed.
	answers   []record
	authority []record
}

// appendQuery appends a recursive query for name (a validated host name
// with a trailing dot, see checkHost) and qtype, with an EDNS(0) OPT record.
func appendQuery(b []byte, id uint16, name string, qtype uint16) []byte {
	b = binary.BigEndian.AppendUint16(b, id)
	b = binary.BigEndian.AppendUint16(b, flagRD)
	b = binary.BigEndian.AppendUint16(b, 1) // QDCOUNT
	b = binary.BigEndian.AppendUint16(b, 0) // ANCOUNT
	b = binary.BigEndian.AppendUint16(b, 0) // NSCOUNT
	b = binary.BigEndian.AppendUint16(b, 1) // ARCOUNT: the OPT record
	for label := range strings.SplitSeq(strings.TrimSuffix(name, "."), ".") {
		b = append(b, byte(len(label)))
		b = append(b, label...)
	}
	b = append(b, 0)
	b = binary.BigEndian.AppendUint16(b, qtype)
	b = binary.BigEndian.AppendUint16(b, classIN)
	// OPT (RFC 6891 §6.1.2): root owner, CLASS is the UDP payload size,
	// TTL holds extended RCODE, version 0 and flags, no options.
	b = append(b, 0)
	b = binary.BigEndian.AppendUint16(b, typeOPT)
	b = binary.BigEndian.AppendUint16(b, udpPayloadSize)
	b = binary.BigEndian.AppendUint32(b, 0)
	b = binary.BigEndian.AppendUint16(b, 0)
	return b
}

// parseMessage parses a DNS message: header, question, answer and authority
// sections. It never reads outside msg and follows at most maxPointers
// compression pointers per name, so it returns an error, never hangs or
// panics, on any input.
func parseMessage(msg []byte) (*message, error) {
	if len(msg) < headerLen {
		return nil, errShortMessage
	}
	flags := binary.BigEndian.Uint16(msg[2:])
	m := &message{
		id:             binary.BigEndian.Uint16(msg[0:]),
		response:       flags&flagQR != 0,
		authoritative:  flags&flagAA != 0,
		truncated:      flags&flagTC != 0,
		recursionAvail: flags&flagRA != 0,
		rcode:          int(flags & 0xF),
	}
	qdcount := int(binary.BigEndian.Uint16(msg[4:]))
	ancount := int(binary.BigEndian.Uint16(msg[6:]))
	nscount := int(binary.BigEndian.Uint16(msg[8:]))
	off := headerLen
	for range qdcount {
		name, next, err := readName(msg, off)
		if err != nil {
			return nil, err
		}
		if next+4 > len(msg) {
			return nil, errShortMessage
		}
		m.questions = append(m.questions, question{
			name:   name,
			qtype:  binary.BigEndian.Uint16(msg[next:]),
			qclass: binary.BigEndian.Uint16(msg[next+2:]),
		})
		off = next + 4
	}
	if m.truncated {
		return m, nil
	}
	var err error
	if m.answers, off, err = parseRecords(msg, off, ancount); err != nil {
		return nil, err
	}
	if m.authority, _, err = parseRecords(msg, off, nscount); err != nil {
		return nil, err
	}
	return m, nil
}

func parseRecords(msg []byte, off, n int) ([]record, int, error) {
	var rrs []record
	for range n {
		var r record
		var err error
		if r.name, off, err = readName(msg, off); err != nil {
			return nil, 0, err
		}
		if off+10 > len(msg) {
			return nil, 0, errShortMessage
		}
		r.rtype = binary.BigEndian.Uint16(msg[off:])
		r.class = binary.BigEndian.Uint16(msg[off+2:])
		r.ttl = binary.BigEndian.Uint32(msg[off+4:])
		if r.ttl > math.MaxInt32 {
			r.ttl = 0
		}
		rdlen := int(binary.BigEndian.Uint16(msg[off+8:]))
		off += 10
		end := off + rdlen
		if end > len(msg) {
			return nil, 0, errShortMessage
		}
		if r.class == classIN {
			if err := parseRData(&r, msg, off, end); err != nil {
				return nil, 0, err
			}
		}
		rrs = append(rrs, r)
		off = end
	}
	return rrs, off, nil
}

// parseRData decodes the data, msg[off:end], of the record types used;
// others are skipped.
func parseRData(r *record, msg []byte, off, end int) error {
	rdata := msg[off:end]
	switch r.rtype {
	case typeA:
		if len(rdata) != 4 {
			return errRDataLength
		}
		r.addr = netip.AddrFrom4([4]byte(rdata))
	case typeAAAA:
		if len(rdata) != 16 {
			return errRDataLength
		}
		r.addr = netip.AddrFrom16([16]byte(rdata))
	case typeCNAME:
		target, next, err := readName(msg, off)
		if err != nil {
			return err
		}
		if next != end {
			return errRDataLength
		}
		r.target = target
	case typeSOA:
		_, next, err := readName(msg, off) // MNAME
		if err != nil {
			return err
		}
		if _, next, err = readName(msg, next); err != nil { // RNAME
			return err
		}
		// SERIAL, REFRESH, RETRY, EXPIRE, MINIMUM
		if next+20 != end {
			return errRDataLength
		}
		r.soaMinimum = binary.BigEndian.Uint32(msg[next+16:])
	}
	return nil
}

// readName reads the domain name at msg[off:], following compression
// pointers (RFC 1035 §4.1.4). It returns the name in lower-case
// presentation form with a trailing dot ("." for the root) and the offset
// just past the name where it starts, i.e. past its first pointer if any.
// Bytes that would make the form ambiguous ('.', '\\', non-printing) are
// escaped as in zone files, so two names are equal exactly when their
// forms are.
func readName(msg []byte, off int) (string, int, error) {
	var b []byte
	wire := 1 // the root label's length byte
	end := -1
	pointers := 0
	for {
		if off >= len(msg) {
			return "", 0, errShortMessage
		}
		c := int(msg[off])
		switch c & 0xC0 {
		case 0x00:
			if c == 0 {
				if end < 0 {
					end = off + 1
				}
				if len(b) == 0 {
					return ".", end, nil
				}
				return string(b), end, nil
			}
			if off+1+c > len(msg) {
				return "", 0, errShortMessage
			}
			if wire += 1 + c; wire > maxNameLen {
				return "", 0, errNameTooLong
			}
			for _, ch := range msg[off+1 : off+1+c] {
				b = appendNameByte(b, ch)
			}
			b = append(b, '.')
			off += 1 + c
		case 0xC0:
			if off+2 > len(msg) {
				return "", 0, errShortMessage
			}
			if pointers++; pointers > maxPointers {
				return "", 0, errPointerLoop
			}
			if end < 0 {
				end = off + 2
			}
			off = int(binary.BigEndian.Uint16(msg[off:]) & 0x3FFF)
		default: // 0x40 (extended, RFC 6891 deprecated it) and 0x80: reserved
			return "", 0, errLabelType
		}
	}
}

func appendNameByte(b []byte, c byte) []byte {
	switch {
	case 'A' <= c && c <= 'Z':
		return append(b, c+'a'-'A')
	case c == '.' || c == '\\':
		return append(b, '\\', c)
	case c < '!' || c > '~':
		b = append(b, '\\')
		if c < 100 {
			b = append(b, '0')
		}
		if c < 10 {
			b = append(b, '0')
		}
		return strconv.AppendUint(b, uint64(c), 10)
	}
	return append(b, c)
}

// result is what one server's reply says about one question.
type result struct {
	addrs []netip.Addr
	// ttl is the smallest TTL of the records used, CNAMEs included; for a
	// negative answer (no addrs), that with the SOA's negative TTL. It is
	// meaningful when addrs is not empty or cacheable is set.
	ttl uint32
	// cacheable is set on a negative answer that carried an SOA record
	// (RFC 2308 §5: without one, it must not be cached).
	cacheable bool
	nxdomain  bool
}

// answer reads the reply m to the question (qname, qtype): it follows the
// CNAME chain from qname through the answer section and takes the qtype
// records at its end. Records off the chain, of other types or classes,
// are ignored.
func answer(m *message, qname string, qtype uint16) (result, error) {
	switch m.rcode {
	case rcodeSuccess, rcodeNXDomain:
	default:
		return result{}, rcodeError(m.rcode)
	}
	res := result{ttl: math.MaxUint32}
	name := qname
	for hops := 0; ; hops++ {
		i := findRecord(m.answers, name, typeCNAME)
		if i < 0 {
			break
		}
		if hops == len(m.answers) {
			return result{}, errCNAMELoop
		}
		res.ttl = min(res.ttl, m.answers[i].ttl)
		name = m.answers[i].target
	}
	if m.rcode == rcodeSuccess {
		for _, r := range m.answers {
			if r.rtype == qtype && r.class == classIN && r.name == name {
				res.addrs = append(res.addrs, r.addr)
				res.ttl = min(res.ttl, r.ttl)
			}
		}
	}
	if len(res.addrs) > 0 {
		return res, nil
	}
	if m.rcode == rcodeSuccess && !m.authoritative && !m.recursionAvail {
		// An empty answer from a server that neither recursed nor owns
		// the name: a referral, which says nothing about the name.
		return result{}, errLameReferral
	}
	res.nxdomain = m.rcode == rcodeNXDomain
	for _, r := range m.authority {
		if r.rtype == typeSOA && r.class == classIN {
			res.ttl = min(res.ttl, r.ttl, r.soaMinimum)
			res.cacheable = true
			break
		}
	}
	return res, nil
}

func findRecord(rrs []record, name string, rtype uint16) int {
	for i, r := range rrs {
		if r.rtype == rtype && r.class == classIN && r.name == name {
			return i
		}
	}
	return -1
}

// checkReply reports why m is not the reply to query id for (qname,
// qtype), or nil if it is.
func checkReply(m *message, id uint16, qname string, qtype uint16) error {
	switch {
	case !m.response:
		return errNotResponse
	case m.id != id:
		return errIDMismatch
	case len(m.questions) != 1 || m.questions[0] != question{qname, qtype, classIN}:
		return errQuestionMismatch
	}
	return nil
}
