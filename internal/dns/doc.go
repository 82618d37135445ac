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
// As with "hosts: files dns", the hosts file comes first: if it names the
// host, its lines are the answer and DNS is not asked, even for the other
// family. Otherwise the A and AAAA questions go out concurrently, each to
// the servers in order until one answers. The hosts file and resolv.conf
// are read again at each Lookup. A host is always fully qualified: resolv.conf's search and ndots
// are not implemented, so a policy writes names in full, and they resolve
// alike on every host.
//
// The TTL is the smallest among the records the answer was built from,
// CNAMEs included, clamped to [MinTTL, MaxTTL]: by default at least 5s,
// since TTL 0 is common and taken literally would re-resolve in a busy loop,
// and at most 1h, so that a long TTL cannot hide a moved service for a day. Hosts-file
// answers get HostsTTL. docs/design.md ("Host names") has the failures,
// their TTLs and the protocol.
package dns
