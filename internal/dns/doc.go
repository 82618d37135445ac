// Package dns resolves host names to addresses together with the time after
// which to resolve them again, which the standard library's net.Resolver
// does not expose. egressd re-resolves host-name destinations on that TTL.
//
//	var r dns.Resolver // /etc/resolv.conf, /etc/hosts, 2s per query
//	addrs, ttl, err := r.Lookup(ctx, "api.example.com")
//	switch {
//	case err == nil: // use addrs, ask again after ttl
//	case errors.Is(err, dns.ErrPartial): // addrs are one family's: keep the other's last ones
//	case dns.IsUnavailable(err): // keep the last addresses, ask again after ttl
//	case dns.IsNotFound(err): // the name has no addresses, ask again after ttl
//	}
//
// # Order of sources
//
// Like the system resolver with "hosts: files dns" in nsswitch.conf, the
// hosts file comes first: if any of its lines names the host, as canonical
// name or alias and ignoring case, Lookup returns the addresses of every
// such line and does not ask DNS, even for the other address family.
// Only then does it ask the servers for A and AAAA records, concurrently,
// each question going to the servers in order until one answers.
// nsswitch.conf itself is not read, and the hosts file and resolv.conf are
// read again on every Lookup, so edits take effect at the next one.
//
// A host that is an IP address literal is returned as it is, with MaxTTL.
//
// # Names
//
// The host is always treated as fully qualified: "db" is asked as "db.",
// never as "db.corp.example." - resolv.conf's search and ndots options
// are not implemented (nor are its other options: the Resolver's fields
// replace timeout and attempts, and rotate is ignored). A destination must
// be written in full in the policy. That also makes the answer the same on
// every host the policy is deployed to, which a search list would not.
//
// # TTLs
//
// The returned TTL is the smallest TTL among the records the answer was
// built from, CNAMEs included, since the answer changes when any of them
// does; it is then clamped to [MinTTL, MaxTTL]:
//
//   - MinTTL (default 5s) is there because TTL 0 ("do not cache") is
//     common for load-balanced and failover names, and taken literally it
//     would make the daemon re-resolve in a busy loop.
//   - MaxTTL (default 1h) is there because a TTL of a day or a week would
//     hide a change - a moved service, a mistake in the zone fixed after
//     the fact - for that long; an hour bounds how stale egressd's view of
//     a destination can be, for the cost of one query per name per hour.
//
// Hosts-file answers have no TTL; they get HostsTTL (30s, clamped too),
// which only decides how soon an edit of the file is seen, since the file
// is read again at each Lookup.
//
// A name that does not exist (NXDOMAIN) or has neither A nor AAAA records
// returns an error matching ErrNotFound, with the negative-caching TTL of
// RFC 2308 (the SOA record's TTL or MINIMUM field, whichever is smaller),
// or MinTTL when the server sent no SOA. When every server fails (a
// timeout, SERVFAIL, REFUSED, a lame reply, a CNAME loop) for both
// questions, Lookup returns an error matching ErrUnavailable and MinTTL:
// the daemon keeps the addresses it had. When they fail for one question
// only, the other's answer stands, an empty one (NODATA, NXDOMAIN) too:
// Lookup returns its addresses with a *PartialError and MinTTL, so that
// the failed question is asked again soon. The daemon keeps the failed
// family's last addresses beside them, rather than dropping a family
// because a packet was lost, and a forwarder that drops AAAA questions
// does not keep a name from resolving.
//
// # Protocol
//
// Messages are built and parsed with golang.org/x/net/dns/dnsmessage, the
// parser of Go's own resolver, with an EDNS(0) OPT record advertising
// 1232-byte UDP replies (RFC 6891, the DNS Flag Day 2020 size). Each query
// has a random ID and its own connected UDP socket, hence a random source
// port; replies whose ID or question do not match, or that do not parse,
// are ignored and the wait for the real reply goes on until the per-query
// Timeout. A truncated (TC) UDP reply makes Lookup ask the same server again
// over TCP, where a reply that does not match or parse fails that server.
// DNSSEC, DNS over TLS or HTTPS, and search domains are not implemented.
//
// A reply does not parse when it is cut short, a name in it follows more
// than 10 compression pointers, is longer than 255 octets, has a reserved
// label type or a '.' inside a label, or an A or AAAA record's data is not
// 4 or 16 bytes. Names in record data (CNAME, SOA) are read as dnsmessage
// (and so Go's resolver) reads them: from the message, without checking
// them against their record's length.
//
// Besides the standard library, the package depends on dnsmessage only.
package dns
