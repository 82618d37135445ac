package dns

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// Defaults for a Resolver's zero fields. See the package documentation for
// why TTLs are clamped.
const (
	DefaultTimeout = 2 * time.Second
	DefaultMinTTL  = 5 * time.Second
	DefaultMaxTTL  = time.Hour
	// HostsTTL is the TTL of an answer from the hosts file, whose entries
	// have none: it decides how soon an edit of the file is seen.
	HostsTTL = 30 * time.Second
)

const (
	defaultHostsFile  = "/etc/hosts"
	defaultResolvConf = "/etc/resolv.conf"
	// maxNameservers is how many resolv.conf nameserver lines are used,
	// as glibc's MAXNS and Go's net package do.
	maxNameservers = 3
)

// defaultServers are used when resolv.conf names none, as glibc and Go do.
var defaultServers = []string{"127.0.0.1:53", "[::1]:53"}

// Resolver looks host names up in the hosts file and DNS. Its zero value
// is ready to use, and it is safe for concurrent use as long as its fields
// are not changed.
type Resolver struct {
	// Servers are the DNS servers, "ip:port" or a bare IP for port 53
	// (IPv6 in brackets with a port: "[2001:db8::53]:53"), asked in order.
	// Empty means the nameserver lines of /etc/resolv.conf (at most three,
	// port 53), read at each Lookup, or 127.0.0.1 and ::1 if it has none.
	Servers []string
	// HostsFile is the hosts(5) file consulted first; empty means
	// /etc/hosts. A missing file is treated as empty.
	HostsFile string
	// Timeout bounds each query (one question to one server); zero means
	// DefaultTimeout. A TCP retry after a truncated reply gets its own.
	Timeout time.Duration
	// MinTTL and MaxTTL clamp the returned TTL; zero means DefaultMinTTL
	// and DefaultMaxTTL. When MinTTL > MaxTTL, MaxTTL wins.
	MinTTL, MaxTTL time.Duration
}

// Lookup returns the IPv4 and IPv6 addresses of host, sorted (IPv4 first)
// and without duplicates, and the TTL after which to look it up again.
//
// The error matches ErrNotFound when the name does not exist or has no
// addresses, and ErrUnavailable when no answer could be had; the returned
// duration is then when to try again (the negative-caching TTL, or
// MinTTL). When one family's question was answered and the other's not,
// the error is a *PartialError and the addresses are the answered
// family's. A host that is not a valid name wraps ErrInvalidName. When ctx
// ends first, the error wraps ctx.Err(). For these last two, and a bad
// Servers entry, the duration is zero.
func (r *Resolver) Lookup(ctx context.Context, host string) ([]netip.Addr, time.Duration, error) {
	if addr, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{addr}, r.maxTTL(), nil
	}
	name, err := checkHost(host)
	if err != nil {
		return nil, 0, fmt.Errorf("lookup %q: %w", host, err)
	}
	addrs, err := r.lookupHosts(name)
	if err != nil {
		return nil, r.minTTL(), &UnavailableError{Host: host, Err: err}
	}
	if len(addrs) > 0 {
		return sortAddrs(addrs), r.clamp(HostsTTL), nil
	}
	servers, err := r.servers()
	if err != nil {
		if errors.Is(err, errBadServer) {
			return nil, 0, fmt.Errorf("lookup %s: %w", host, err)
		}
		return nil, r.minTTL(), &UnavailableError{Host: host, Err: err}
	}
	return r.lookupDNS(ctx, host, name+".", servers)
}

func (r *Resolver) lookupDNS(ctx context.Context, host, qname string, servers []string) ([]netip.Addr, time.Duration, error) {
	var a, aaaa result
	var errA, errAAAA error
	var wg sync.WaitGroup
	wg.Go(func() { a, errA = r.ask(ctx, servers, qname, dnsmessage.TypeA) })
	wg.Go(func() { aaaa, errAAAA = r.ask(ctx, servers, qname, dnsmessage.TypeAAAA) })
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, 0, fmt.Errorf("lookup %s: %w", host, err)
	}
	if errA != nil && errAAAA != nil {
		return nil, r.minTTL(), &UnavailableError{Host: host, Err: errors.Join(errA, errAAAA)}
	}
	// One family answered, if only that it has no addresses: a forwarder
	// that drops AAAA questions must not keep a name from resolving.
	if errA != nil || errAAAA != nil {
		return sortAddrs(append(a.addrs, aaaa.addrs...)), r.minTTL(), &PartialError{Host: host, IPv6: errAAAA != nil, Err: errors.Join(errA, errAAAA)}
	}
	addrs := append(a.addrs, aaaa.addrs...)
	// The TTL covers every record the answer rests on: the addresses, and
	// a family's negative answer, which may turn positive after its TTL.
	ttl := uint32(math.MaxUint32)
	for _, res := range []result{a, aaaa} {
		if len(res.addrs) > 0 || res.cacheable {
			ttl = min(ttl, res.ttl)
		}
	}
	if len(addrs) == 0 {
		err := &NotFoundError{Host: host, NXDomain: a.nxdomain || aaaa.nxdomain}
		if ttl == math.MaxUint32 { // no SOA: must not be cached
			return nil, r.minTTL(), err
		}
		return nil, r.clamp(time.Duration(ttl) * time.Second), err
	}
	return sortAddrs(addrs), r.clamp(time.Duration(ttl) * time.Second), nil
}

// ask puts one question to the servers in order until one answers it.
func (r *Resolver) ask(ctx context.Context, servers []string, qname string, qtype dnsmessage.Type) (result, error) {
	var errs []error
	for _, server := range servers {
		res, err := r.exchange(ctx, server, qname, qtype)
		if err == nil {
			return res, nil
		}
		if ctx.Err() != nil {
			return result{}, ctx.Err()
		}
		errs = append(errs, fmt.Errorf("%s %s: %w", server, typeName(qtype), err))
	}
	return result{}, errors.Join(errs...)
}

func sortAddrs(addrs []netip.Addr) []netip.Addr {
	slices.SortFunc(addrs, netip.Addr.Compare)
	return slices.Compact(addrs)
}

// checkHost validates host as a domain name (RFC 1035 §2.3.1, with '_'
// allowed as in practice and as Go's net package does) and returns it lower-
// cased without a trailing dot.
func checkHost(host string) (string, error) {
	name := strings.TrimSuffix(host, ".")
	if name == "" {
		return "", fmt.Errorf("%w: empty", ErrInvalidName)
	}
	if len(name) > 253 {
		return "", fmt.Errorf("%w: longer than 253 characters", ErrInvalidName)
	}
	for label := range strings.SplitSeq(name, ".") {
		switch {
		case label == "":
			return "", fmt.Errorf("%w: empty label", ErrInvalidName)
		case len(label) > maxLabelLen:
			return "", fmt.Errorf("%w: label longer than 63 characters", ErrInvalidName)
		case label[0] == '-' || label[len(label)-1] == '-':
			return "", fmt.Errorf("%w: label %q starts or ends with '-'", ErrInvalidName, label)
		}
		for _, c := range []byte(label) {
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return "", fmt.Errorf("%w: label %q has %q", ErrInvalidName, label, c)
			}
		}
	}
	return strings.ToLower(name), nil
}

func (r *Resolver) timeout() time.Duration {
	if r.Timeout > 0 {
		return r.Timeout
	}
	return DefaultTimeout
}

func (r *Resolver) minTTL() time.Duration {
	if r.MinTTL > 0 {
		return min(r.MinTTL, r.maxTTL())
	}
	return min(DefaultMinTTL, r.maxTTL())
}

func (r *Resolver) maxTTL() time.Duration {
	if r.MaxTTL > 0 {
		return r.MaxTTL
	}
	return DefaultMaxTTL
}

func (r *Resolver) clamp(ttl time.Duration) time.Duration {
	return min(max(ttl, r.minTTL()), r.maxTTL())
}

// lookupHosts returns the addresses the hosts file gives name.
func (r *Resolver) lookupHosts(name string) ([]netip.Addr, error) {
	path := r.HostsFile
	if path == "" {
		path = defaultHostsFile
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("hosts file: %w", err)
	}
	return parseHosts(data, name), nil
}

// parseHosts returns the addresses of the lines of a hosts(5) file that
// name name (lower-case, no trailing dot) as canonical name or alias.
func parseHosts(data []byte, name string) []netip.Addr {
	var addrs []netip.Addr
	for line := range strings.Lines(string(data)) {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		fields := strings.Fields(line)
		if len(fields) < 2 {
			continue
		}
		addr, err := netip.ParseAddr(fields[0])
		if err != nil {
			continue
		}
		for _, h := range fields[1:] {
			if strings.EqualFold(strings.TrimSuffix(h, "."), name) {
				addrs = append(addrs, addr)
				break
			}
		}
	}
	return addrs
}

var errBadServer = errors.New("not an IP address or IP:port")

func (r *Resolver) servers() ([]string, error) {
	if len(r.Servers) == 0 {
		data, err := os.ReadFile(defaultResolvConf)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("resolv.conf: %w", err)
		}
		return parseResolvConf(data), nil
	}
	servers := make([]string, 0, len(r.Servers))
	for _, s := range r.Servers {
		if ap, err := netip.ParseAddrPort(s); err == nil {
			servers = append(servers, ap.String())
		} else if a, err := netip.ParseAddr(s); err == nil {
			servers = append(servers, netip.AddrPortFrom(a, 53).String())
		} else {
			return nil, fmt.Errorf("dns server %q: %w", s, errBadServer)
		}
	}
	return servers, nil
}

// parseResolvConf returns the servers named by the nameserver lines of a
// resolv.conf(5) file, as "ip:53" or "[ipv6]:53", at most maxNameservers,
// or defaultServers if there are none.
func parseResolvConf(data []byte) []string {
	var servers []string
	for line := range strings.Lines(string(data)) {
		if i := strings.IndexAny(line, "#;"); i >= 0 {
			line = line[:i]
		}
		fields := strings.Fields(line)
		if len(fields) < 2 || fields[0] != "nameserver" {
			continue
		}
		addr, err := netip.ParseAddr(fields[1])
		if err != nil {
			continue
		}
		servers = append(servers, netip.AddrPortFrom(addr, 53).String())
		if len(servers) == maxNameservers {
			break
		}
	}
	if len(servers) == 0 {
		return slices.Clone(defaultServers)
	}
	return servers
}
