package serve

import (
	"net/http"
	"net/netip"
)

// ByClientIP is a Partition func: the address of the peer (r.RemoteAddr,
// port dropped). An IPv6 client is its /64 prefix, since one host commonly
// holds a whole /64 and could otherwise take a fresh budget per address; an
// IPv4-mapped IPv6 address is its IPv4 address. A RemoteAddr that is not an
// address and port (a unix socket's) is used as it is.
//
// Behind a proxy or a load balancer the peer is the proxy, and every client
// shares its budget: partition by a header the proxy sets, and that clients
// cannot, instead (ByHeader).
func ByClientIP(r *http.Request) string { return AddrKey(r.RemoteAddr) }

// AddrKey is ByClientIP's key for a peer's address given as "host:port":
// the address, an IPv6 one as its /64, an IPv4-mapped one as IPv4; anything
// else as it is. Package servegrpc partitions gRPC peers by it.
func AddrKey(addr string) string {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return addr
	}
	a := ap.Addr().Unmap().WithZone("")
	if a.Is6() {
		p, _ := a.Prefix(64) // 64 is within an IPv6 address's 128 bits
		return p.String()
	}
	return a.String()
}

// ByHeader returns a Partition func that reads the header name: a tenant
// or API key header, or one a trusted proxy sets to the client's address.
// A request without it is in the partition "", which every such request
// shares. The client chooses the value: the partitioned limiter keeps one
// longer than partition.MaxKeyLen shortened.
func ByHeader(name string) func(r *http.Request) string {
	key := http.CanonicalHeaderKey(name)
	return func(r *http.Request) string {
		if vs := r.Header[key]; len(vs) > 0 {
			return vs[0]
		}
		return ""
	}
}
