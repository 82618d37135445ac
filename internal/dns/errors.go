package dns

import (
	"errors"
	"net/netip"
	"strconv"

	"golang.org/x/net/dns/dnsmessage"
)

var (
	// ErrNotFound is matched by every *NotFoundError: the name does not exist,
	// or has neither A nor AAAA records.
	ErrNotFound = errors.New("no such host")
	// ErrUnavailable is matched by every *UnavailableError: no server gave an
	// answer, so nothing is known about the name's addresses.
	ErrUnavailable = errors.New("dns unavailable")
	// ErrPartial is matched by every *PartialError: one address family's
	// question was answered, the other's not.
	ErrPartial = errors.New("one address family unanswered")
	// ErrInvalidName is wrapped by the error Lookup returns for a host that is
	// not a valid domain name; no query is sent.
	ErrInvalidName = errors.New("invalid host name")
)

// NotFoundError says the servers answered, and the answer is that the host
// has no addresses.
type NotFoundError struct {
	Host string
	// NXDomain is true when the name does not exist at all, false when it
	// exists but has no A or AAAA records (NODATA).
	NXDomain bool
}

func (e *NotFoundError) Error() string {
	if e.NXDomain {
		return "lookup " + e.Host + ": no such host"
	}
	return "lookup " + e.Host + ": no addresses"
}

// Is matches ErrNotFound.
func (e *NotFoundError) Is(target error) bool { return target == ErrNotFound }

// UnavailableError says no answer could be had: every server failed for at
// least one of the questions, or the hosts file could not be read.
type UnavailableError struct {
	Host string
	// Err holds the failures, one per server and question
	// (errors.Join), or the hosts file's read error.
	Err error
}

func (e *UnavailableError) Error() string {
	s := "lookup " + e.Host + ": " + ErrUnavailable.Error()
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is matches ErrUnavailable.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

// Unwrap returns the failures.
func (e *UnavailableError) Unwrap() error { return e.Err }

// PartialError says every server failed one family's question while the
// other's was answered. Lookup returns it with the answered family's
// addresses, maybe none, and MinTTL, so that the other family is asked
// again soon; a caller keeps the addresses it had of the unanswered family.
type PartialError struct {
	Host string
	// IPv6 is true when the AAAA question went unanswered, false when the
	// A question did.
	IPv6 bool
	// Err holds the failures, one per server.
	Err error
}

func (e *PartialError) Error() string {
	q := "A"
	if e.IPv6 {
		q = "AAAA"
	}
	return "lookup " + e.Host + ": no answer for " + q + ": " + e.Err.Error()
}

// Is matches ErrPartial.
func (e *PartialError) Is(target error) bool { return target == ErrPartial }

// Unwrap returns the failures.
func (e *PartialError) Unwrap() error { return e.Err }

// Unanswered reports whether a is of the family that went unanswered.
func (e *PartialError) Unanswered(a netip.Addr) bool { return a.Is4() != e.IPv6 }

// IsNotFound reports whether err is, or wraps, a *NotFoundError.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsUnavailable reports whether err is, or wraps, a *UnavailableError.
func IsUnavailable(err error) bool { return errors.Is(err, ErrUnavailable) }

// rcodeError is a reply whose RCODE says the server could not answer.
type rcodeError dnsmessage.RCode

func (e rcodeError) Error() string {
	if s, ok := rcodeNames[dnsmessage.RCode(e)]; ok {
		return "server replied " + s
	}
	return "server replied rcode " + strconv.Itoa(int(e))
}

// rcodeNames are the mnemonics of RFC 1035 §4.1.1, which dig and logs use
// (dnsmessage's String gives "RCodeServerFailure").
var rcodeNames = map[dnsmessage.RCode]string{
	dnsmessage.RCodeFormatError:    "FORMERR",
	dnsmessage.RCodeServerFailure:  "SERVFAIL",
	dnsmessage.RCodeNameError:      "NXDOMAIN",
	dnsmessage.RCodeNotImplemented: "NOTIMP",
	dnsmessage.RCodeRefused:        "REFUSED",
}

// Reasons a reply is ignored or a server's answer is not used.
var (
	errMalformed        = errors.New("malformed dns message")
	errNotResponse      = errors.New("reply is not a response")
	errIDMismatch       = errors.New("reply ID does not match the query")
	errQuestionMismatch = errors.New("reply question does not match the query")
	errLameReferral     = errors.New("lame referral (neither recursion available nor authoritative)")
	errCNAMELoop        = errors.New("CNAME loop")
	errTruncatedTCP     = errors.New("truncated reply over TCP")
)

func typeName(t dnsmessage.Type) string {
	switch t {
	case dnsmessage.TypeA:
		return "A"
	case dnsmessage.TypeAAAA:
		return "AAAA"
	}
	return "TYPE" + strconv.Itoa(int(t))
}
