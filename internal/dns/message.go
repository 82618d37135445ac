package dns

import (
	"errors"
	"fmt"
	"math"
	"net/netip"

	"golang.org/x/net/dns/dnsmessage"
)

const (
	maxLabelLen = 63
	// udpPayloadSize is the UDP reply size advertised with EDNS(0): the
	// DNS Flag Day 2020 value, which avoids IP fragmentation.
	udpPayloadSize = 1232
)

// What a reply says, as far as answering one question needs: the fields
// dnsmessage parsed, with names in one comparable form (see nameString).
type question struct {
	name   string
	qtype  dnsmessage.Type
	qclass dnsmessage.Class
}

type record struct {
	name  string
	rtype dnsmessage.Type
	class dnsmessage.Class
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
	rcode          dnsmessage.RCode
	questions      []question
	// answers and authority are not parsed when truncated is set: a
	// truncated message is only used to decide to retry over TCP. The
	// additional section is never parsed.
	answers   []record
	authority []record
}

// appendQuery appends a recursive query for name (a valid host name with a
// trailing dot, see checkHost) and qtype, with an EDNS(0) OPT record.
func appendQuery(b []byte, id uint16, name string, qtype dnsmessage.Type) ([]byte, error) {
	qname, err := dnsmessage.NewName(name)
	if err != nil {
		return nil, err
	}
	m := dnsmessage.NewBuilder(b, dnsmessage.Header{ID: id, RecursionDesired: true})
	var opt dnsmessage.ResourceHeader
	err = errors.Join(
		m.StartQuestions(),
		m.Question(dnsmessage.Question{Name: qname, Type: qtype, Class: dnsmessage.ClassINET}),
		m.StartAdditionals(),
		opt.SetEDNS0(udpPayloadSize, dnsmessage.RCodeSuccess, false),
		m.OPTResource(opt, dnsmessage.OPTResource{}),
	)
	if err != nil {
		return nil, fmt.Errorf("query for %s: %w", name, err)
	}
	return m.Finish()
}

// parseMessage parses a DNS message with dnsmessage: header, questions, and
// unless it is truncated the answer and authority sections. Any error
// matches errMalformed.
func parseMessage(msg []byte) (*message, error) {
	var p dnsmessage.Parser
	h, err := p.Start(msg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errMalformed, err)
	}
	m := &message{
		id:             h.ID,
		response:       h.Response,
		authoritative:  h.Authoritative,
		truncated:      h.Truncated,
		recursionAvail: h.RecursionAvailable,
		rcode:          h.RCode,
	}
	qs, err := p.AllQuestions()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errMalformed, err)
	}
	for _, q := range qs {
		m.questions = append(m.questions, question{nameString(q.Name), q.Type, q.Class})
	}
	if m.truncated {
		return m, nil
	}
	if m.answers, err = parseRecords(&p, p.AnswerHeader, p.SkipAnswer); err != nil {
		return nil, fmt.Errorf("%w: answer: %w", errMalformed, err)
	}
	if m.authority, err = parseRecords(&p, p.AuthorityHeader, p.SkipAuthority); err != nil {
		return nil, fmt.Errorf("%w: authority: %w", errMalformed, err)
	}
	return m, nil
}

// parseRecords parses the records of the section that header and skip
// read. The data of the record types answer uses is decoded; that of others
// is skipped, its length checked against the message.
func parseRecords(p *dnsmessage.Parser, header func() (dnsmessage.ResourceHeader, error), skip func() error) ([]record, error) {
	var rrs []record
	for {
		h, err := header()
		if err == dnsmessage.ErrSectionDone {
			return rrs, nil
		}
		if err != nil {
			return nil, err
		}
		r := record{name: nameString(h.Name), rtype: h.Type, class: h.Class, ttl: h.TTL}
		if r.ttl > math.MaxInt32 {
			r.ttl = 0
		}
		if err := parseRData(p, &r, h, skip); err != nil {
			return nil, err
		}
		rrs = append(rrs, r)
	}
}

func parseRData(p *dnsmessage.Parser, r *record, h dnsmessage.ResourceHeader, skip func() error) error {
	if h.Class != dnsmessage.ClassINET {
		return skip()
	}
	// An address whose RDLENGTH is not its size is malformed (RFC 1035
	// §3.4.1); dnsmessage reads the size whatever RDLENGTH says.
	switch h.Type {
	case dnsmessage.TypeA:
		if h.Length != 4 {
			return fmt.Errorf("type A record with %d bytes of data", h.Length)
		}
		a, err := p.AResource()
		r.addr = netip.AddrFrom4(a.A)
		return err
	case dnsmessage.TypeAAAA:
		if h.Length != 16 {
			return fmt.Errorf("type AAAA record with %d bytes of data", h.Length)
		}
		a, err := p.AAAAResource()
		r.addr = netip.AddrFrom16(a.AAAA)
		return err
	case dnsmessage.TypeCNAME:
		c, err := p.CNAMEResource()
		r.target = nameString(c.CNAME)
		return err
	case dnsmessage.TypeSOA:
		s, err := p.SOAResource()
		r.soaMinimum = s.MinTTL
		return err
	}
	return skip()
}

// nameString returns n with ASCII letters in lower case, so that names
// compare as DNS compares them (RFC 4343). dnsmessage refuses labels that
// hold a '.', so the form is unambiguous; other bytes, even non-printing
// ones, are kept as they are (strings.ToLower would turn invalid UTF-8 into
// U+FFFD and make different names equal).
func nameString(n dnsmessage.Name) string {
	b := []byte(n.String())
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
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
func answer(m *message, qname string, qtype dnsmessage.Type) (result, error) {
	switch m.rcode {
	case dnsmessage.RCodeSuccess, dnsmessage.RCodeNameError:
	default:
		return result{}, rcodeError(m.rcode)
	}
	res := result{ttl: math.MaxUint32}
	name := qname
	for hops := 0; ; hops++ {
		i := findRecord(m.answers, name, dnsmessage.TypeCNAME)
		if i < 0 {
			break
		}
		if hops == len(m.answers) {
			return result{}, errCNAMELoop
		}
		res.ttl = min(res.ttl, m.answers[i].ttl)
		name = m.answers[i].target
	}
	if m.rcode == dnsmessage.RCodeSuccess {
		for _, r := range m.answers {
			if r.rtype == qtype && r.class == dnsmessage.ClassINET && r.name == name {
				res.addrs = append(res.addrs, r.addr)
				res.ttl = min(res.ttl, r.ttl)
			}
		}
	}
	if len(res.addrs) > 0 {
		return res, nil
	}
	if m.rcode == dnsmessage.RCodeSuccess && !m.authoritative && !m.recursionAvail {
		// An empty answer from a server that neither recursed nor owns
		// the name: a referral, which says nothing about the name.
		return result{}, errLameReferral
	}
	res.nxdomain = m.rcode == dnsmessage.RCodeNameError
	for _, r := range m.authority {
		if r.rtype == dnsmessage.TypeSOA && r.class == dnsmessage.ClassINET {
			res.ttl = min(res.ttl, r.ttl, r.soaMinimum)
			res.cacheable = true
			break
		}
	}
	return res, nil
}

func findRecord(rrs []record, name string, rtype dnsmessage.Type) int {
	for i, r := range rrs {
		if r.rtype == rtype && r.class == dnsmessage.ClassINET && r.name == name {
			return i
		}
	}
	return -1
}

// readReply parses msg and returns it if it is the reply to query id for
// (qname, qtype), or why not.
func readReply(msg []byte, id uint16, qname string, qtype dnsmessage.Type) (*message, error) {
	m, err := parseMessage(msg)
	if err != nil {
		return nil, err
	}
	if err := checkReply(m, id, qname, qtype); err != nil {
		return nil, err
	}
	return m, nil
}

// checkReply reports why m is not the reply to query id for (qname,
// qtype), or nil if it is.
func checkReply(m *message, id uint16, qname string, qtype dnsmessage.Type) error {
	switch {
	case !m.response:
		return errNotResponse
	case m.id != id:
		return errIDMismatch
	case len(m.questions) != 1 || m.questions[0] != question{qname, qtype, dnsmessage.ClassINET}:
		return errQuestionMismatch
	}
	return nil
}
