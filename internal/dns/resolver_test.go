package dns

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// newResolver returns a Resolver that asks only the given loopback servers
// and reads an empty hosts file: tests never read /etc/resolv.conf or
// /etc/hosts, nor send anything off the machine.
func newResolver(t *testing.T, servers ...string) *Resolver {
	t.Helper()
	if len(servers) == 0 {
		t.Fatal("newResolver without servers would use /etc/resolv.conf")
	}
	hosts := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hosts, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return &Resolver{Servers: servers, HostsFile: hosts, Timeout: time.Second}
}

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

var zone = []testRR{
	{"www.example.", typeA, 600, "192.0.2.1"},
	{"www.example.", typeAAAA, 120, "2001:db8::1"},
	{"www.example.", typeA, 300, "192.0.2.2"},
	{"www.example.", typeA, 600, "192.0.2.1"}, // a duplicate
	{"v4only.example.", typeA, 300, "192.0.2.3"},
	{"alias.example.", typeCNAME, 30, "mid.example.net."},
	{"mid.example.net.", typeCNAME, 600, "host.example.org."},
	{"host.example.org.", typeAAAA, 900, "2001:db8::4"},
	{"host.example.org.", typeA, 300, "192.0.2.4"},
	{"zero.example.", typeA, 0, "192.0.2.5"},
	{"day.example.", typeA, 86400, "192.0.2.6"},
	{"day.example.", typeAAAA, 604800, "2001:db8::6"},
	{"mx-only.example.", typeMX, 300, ""},
	{"dangling.example.", typeCNAME, 60, "nowhere.example."},
	{"loop1.example.", typeCNAME, 60, "loop2.example."},
	{"loop2.example.", typeCNAME, 60, "loop1.example."},
}

var (
	good      = serverConfig{records: zone, soaTTL: 900, soaMinimum: 120}
	goodNoSOA = serverConfig{records: zone}
)

func TestLookup(t *testing.T) {
	tests := []struct {
		name           string
		servers        []serverConfig
		minTTL, maxTTL time.Duration
		host           string
		wantAddrs      []netip.Addr
		wantTTL        time.Duration
		wantErr        error
		wantNXDomain   bool
	}{
		{
			name:      "both families sorted and deduplicated, smallest TTL",
			servers:   []serverConfig{good},
			host:      "www.example",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"),
			wantTTL:   120 * time.Second,
		},
		{
			name:      "upper case and trailing dot",
			servers:   []serverConfig{good},
			host:      "WWW.Example.",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"),
			wantTTL:   120 * time.Second,
		},
		{
			name:      "one family: the other's negative TTL counts",
			servers:   []serverConfig{good},
			host:      "v4only.example",
			wantAddrs: addrs("192.0.2.3"),
			wantTTL:   120 * time.Second, // min(300, SOA TTL 900, MINIMUM 120)
		},
		{
			name:      "one family, no SOA for the other",
			servers:   []serverConfig{goodNoSOA},
			host:      "v4only.example",
			wantAddrs: addrs("192.0.2.3"),
			wantTTL:   300 * time.Second,
		},
		{
			name:      "CNAME chain: smallest TTL, CNAMEs included",
			servers:   []serverConfig{good},
			host:      "alias.example",
			wantAddrs: addrs("192.0.2.4", "2001:db8::4"),
			wantTTL:   30 * time.Second,
		},
		{
			name:      "TTL 0 raised to MinTTL",
			servers:   []serverConfig{goodNoSOA},
			host:      "zero.example",
			wantAddrs: addrs("192.0.2.5"),
			wantTTL:   DefaultMinTTL,
		},
		{
			name:      "day-long TTL lowered to MaxTTL",
			servers:   []serverConfig{good},
			host:      "day.example",
			wantAddrs: addrs("192.0.2.6", "2001:db8::6"),
			wantTTL:   DefaultMaxTTL,
		},
		{
			name:      "own MinTTL",
			servers:   []serverConfig{goodNoSOA},
			minTTL:    time.Second,
			host:      "zero.example",
			wantAddrs: addrs("192.0.2.5"),
			wantTTL:   time.Second,
		},
		{
			name:      "own MaxTTL",
			servers:   []serverConfig{good},
			maxTTL:    10 * time.Minute,
			host:      "day.example",
			wantAddrs: addrs("192.0.2.6", "2001:db8::6"),
			wantTTL:   10 * time.Minute,
		},
		{
			name:         "NXDOMAIN: negative TTL from the SOA",
			servers:      []serverConfig{good},
			host:         "nope.example",
			wantTTL:      120 * time.Second,
			wantErr:      ErrNotFound,
			wantNXDomain: true,
		},
		{
			name:         "NXDOMAIN without SOA: MinTTL",
			servers:      []serverConfig{goodNoSOA},
			host:         "nope.example",
			wantTTL:      DefaultMinTTL,
			wantErr:      ErrNotFound,
			wantNXDomain: true,
		},
		{
			name:    "no address records (NODATA)",
			servers: []serverConfig{good},
			host:    "mx-only.example",
			wantTTL: 120 * time.Second,
			wantErr: ErrNotFound,
		},
		{
			name:         "CNAME to a name that does not exist",
			servers:      []serverConfig{good},
			host:         "dangling.example",
			wantTTL:      60 * time.Second, // the CNAME's
			wantErr:      ErrNotFound,
			wantNXDomain: true,
		},
		{
			name:    "CNAME loop",
			servers: []serverConfig{good},
			host:    "loop1.example",
			wantTTL: DefaultMinTTL,
			wantErr: ErrUnavailable,
		},
		{
			name:    "SERVFAIL from every server",
			servers: []serverConfig{{rcode: dnsmessage.RCodeServerFailure}, {rcode: dnsmessage.RCodeServerFailure}},
			host:    "www.example",
			wantTTL: DefaultMinTTL,
			wantErr: ErrUnavailable,
		},
		{
			name:      "AAAA SERVFAIL: the A answer, asked again soon",
			servers:   []serverConfig{{records: zone, servfail: typeAAAA}},
			host:      "www.example",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2"),
			wantTTL:   DefaultMinTTL,
			wantErr:   ErrPartial,
		},
		{
			name:      "A dropped: the AAAA answer",
			servers:   []serverConfig{{records: zone, drop: typeA}},
			host:      "www.example",
			wantAddrs: addrs("2001:db8::1"),
			wantTTL:   DefaultMinTTL,
			wantErr:   ErrPartial,
		},
		{
			name:    "AAAA dropped, no A records (NODATA): an answer all the same",
			servers: []serverConfig{{records: zone, drop: typeAAAA}},
			host:    "mx-only.example",
			wantTTL: DefaultMinTTL,
			wantErr: ErrPartial,
		},
		{
			name:      "SERVFAIL, then an answer",
			servers:   []serverConfig{{rcode: dnsmessage.RCodeServerFailure}, good},
			host:      "www.example",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"),
			wantTTL:   120 * time.Second,
		},
		{
			name:      "REFUSED, then an answer",
			servers:   []serverConfig{{rcode: dnsmessage.RCodeRefused}, good},
			host:      "www.example",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"),
			wantTTL:   120 * time.Second,
		},
		{
			name:    "lame referral, then an answer",
			servers: []serverConfig{{records: zone, lame: true}, good},
			host:    "mx-only.example",
			wantTTL: 120 * time.Second,
			wantErr: ErrNotFound,
		},
		{
			name:    "lame referral only",
			servers: []serverConfig{{records: zone, lame: true}},
			host:    "mx-only.example",
			wantTTL: DefaultMinTTL,
			wantErr: ErrUnavailable,
		},
		{
			name:      "forged replies ignored",
			servers:   []serverConfig{{records: zone, forge: true}},
			host:      "www.example",
			wantAddrs: addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"),
			wantTTL:   120 * time.Second,
		},
		{
			name:      "truncated UDP reply: asked again over TCP",
			servers:   []serverConfig{{records: zone, truncateUDP: true}},
			host:      "alias.example",
			wantAddrs: addrs("192.0.2.4", "2001:db8::4"),
			wantTTL:   30 * time.Second,
		},
		{
			name:    "truncated over TCP too",
			servers: []serverConfig{{records: zone, truncateUDP: true, truncateTCP: true}},
			host:    "www.example",
			wantTTL: DefaultMinTTL,
			wantErr: ErrUnavailable,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var servers []string
			for _, cfg := range tt.servers {
				servers = append(servers, startServer(t, cfg).addr)
			}
			r := newResolver(t, servers...)
			r.MinTTL, r.MaxTTL = tt.minTTL, tt.maxTTL

			got, ttl, err := r.Lookup(t.Context(), tt.host)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Lookup(%q) error = %v, want %v", tt.host, err, tt.wantErr)
			}
			if !slices.Equal(got, tt.wantAddrs) || ttl != tt.wantTTL {
				t.Errorf("Lookup(%q) = %v, %v; want %v, %v", tt.host, got, ttl, tt.wantAddrs, tt.wantTTL)
			}
			var nf *NotFoundError
			if gotNX := errors.As(err, &nf) && nf.NXDomain; gotNX != tt.wantNXDomain {
				t.Errorf("NXDomain = %v, want %v (%v)", gotNX, tt.wantNXDomain, err)
			}
		})
	}
}

func TestLookupTruncatedUsesTCP(t *testing.T) {
	s := startServer(t, serverConfig{records: zone, truncateUDP: true})
	got, _, err := newResolver(t, s.addr).Lookup(t.Context(), "www.example")
	if err != nil {
		t.Fatal(err)
	}
	if want := addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"); !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if u, tc := s.udpQueries.Load(), s.tcpQueries.Load(); u != 2 || tc != 2 {
		t.Errorf("queries: %d UDP, %d TCP; want 2 and 2", u, tc)
	}
}

func TestLookupSlowServerTimesOut(t *testing.T) {
	slow := startServer(t, serverConfig{records: zone, delay: 10 * time.Second})
	fast := startServer(t, good)
	r := newResolver(t, slow.addr, fast.addr)
	r.Timeout = 200 * time.Millisecond

	start := time.Now()
	got, ttl, err := r.Lookup(t.Context(), "www.example")
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if want := addrs("192.0.2.1", "192.0.2.2", "2001:db8::1"); !slices.Equal(got, want) || ttl != 120*time.Second {
		t.Errorf("got %v, %v; want %v, 2m0s", got, ttl, want)
	}
	if n := slow.udpQueries.Load(); n != 2 {
		t.Errorf("slow server got %d queries, want 2", n)
	}
	// A and AAAA are asked concurrently: one timeout, not two.
	if elapsed < r.Timeout || elapsed > 2*r.Timeout+500*time.Millisecond {
		t.Errorf("took %v with a %v timeout", elapsed, r.Timeout)
	}
}

func TestLookupNoServerAnswers(t *testing.T) {
	a := startServer(t, serverConfig{silent: true})
	b := startServer(t, serverConfig{silent: true})
	r := newResolver(t, a.addr, b.addr)
	r.Timeout = 100 * time.Millisecond

	start := time.Now()
	_, ttl, err := r.Lookup(t.Context(), "www.example")
	elapsed := time.Since(start)
	if !IsUnavailable(err) || !errors.Is(err, os.ErrDeadlineExceeded) || ttl != DefaultMinTTL {
		t.Fatalf("got %v, %v; want an ErrUnavailable timeout, %v", ttl, err, DefaultMinTTL)
	}
	for _, want := range []string{a.addr + " A:", b.addr + " AAAA:"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if elapsed < 2*r.Timeout || elapsed > 2*r.Timeout+500*time.Millisecond {
		t.Errorf("took %v, want about 2×%v", elapsed, r.Timeout)
	}
}

func TestLookupConnectionRefused(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, closedPort(t), s.addr)
	r.Timeout = 5 * time.Second // refused must not wait for it

	start := time.Now()
	got, _, err := r.Lookup(t.Context(), "v4only.example")
	if err != nil || !slices.Equal(got, addrs("192.0.2.3")) {
		t.Fatalf("got %v, %v", got, err)
	}
	if elapsed := time.Since(start); elapsed > time.Second {
		t.Errorf("took %v", elapsed)
	}
}

func TestLookupContextCanceled(t *testing.T) {
	s := startServer(t, serverConfig{silent: true})
	r := newResolver(t, s.addr)
	r.Timeout = time.Minute
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	t.Cleanup(cancel)

	start := time.Now()
	_, ttl, err := r.Lookup(ctx, "www.example")
	if !errors.Is(err, context.DeadlineExceeded) || IsUnavailable(err) || ttl != 0 {
		t.Errorf("got %v, %v; want the context's error, 0", ttl, err)
	}
	if elapsed := time.Since(start); elapsed > time.Second {
		t.Errorf("took %v after the context ended", elapsed)
	}
}

// TestLookupQueries checks what goes on the wire: one A and one AAAA query
// per lookup, recursion desired, EDNS(0) with 1232 bytes, the name in
// lower case, and IDs that vary.
func TestLookupQueries(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	const lookups = 20
	for range lookups {
		if _, _, err := r.Lookup(t.Context(), "WWW.example"); err != nil {
			t.Fatal(err)
		}
	}
	queries := s.received()
	if len(queries) != 2*lookups {
		t.Fatalf("%d queries, want %d", len(queries), 2*lookups)
	}
	ids := map[uint16]bool{}
	types := map[dnsmessage.Type]int{}
	for _, q := range queries {
		if len(q) < 2 {
			t.Fatalf("query % x", q)
		}
		id := binary.BigEndian.Uint16(q)
		qtype := typeA
		if bytes.Equal(q, queryBytes(id, typeAAAA)) {
			qtype = typeAAAA
		} else if !bytes.Equal(q, queryBytes(id, typeA)) {
			t.Fatalf("query\n% x\nwant RD only, www.example. in lower case, EDNS(0) for 1232 bytes:\n% x", q, queryBytes(id, typeA))
		}
		ids[id] = true
		types[qtype]++
	}
	if types[typeA] != lookups || types[typeAAAA] != lookups {
		t.Errorf("query types %v", types)
	}
	// 40 random 16-bit IDs: a few may collide, not many.
	if len(ids) < 2*lookups-4 {
		t.Errorf("only %d distinct IDs in %d queries", len(ids), 2*lookups)
	}
}

// TestLookupLongestName: a name of 253 characters, 255 octets on the wire,
// is asked and its reply read.
func TestLookupLongestName(t *testing.T) {
	host := strings.Join([]string{strings.Repeat("a", 63), strings.Repeat("b", 63), strings.Repeat("c", 63), strings.Repeat("d", 61)}, ".")
	s := startServer(t, serverConfig{records: []testRR{{host + ".", typeA, 300, "192.0.2.7"}}})
	got, ttl, err := newResolver(t, s.addr).Lookup(t.Context(), host)
	if err != nil || !slices.Equal(got, addrs("192.0.2.7")) || ttl != 300*time.Second {
		t.Errorf("Lookup(%d characters) = %v, %v, %v", len(host), got, ttl, err)
	}
}

func TestLookupInvalidHost(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	for _, host := range []string{
		"",
		".",
		"..",
		"a..example",
		"www.example..",
		".www.example",
		"-www.example",
		"www-.example",
		"w w.example",
		"www.exa\\mple",
		"www.exämple",
		"www.example/",
		strings.Repeat("a", 64) + ".example",
		strings.Repeat("a.", 126) + "ab", // 254 characters
	} {
		_, ttl, err := r.Lookup(t.Context(), host)
		if !errors.Is(err, ErrInvalidName) || ttl != 0 {
			t.Errorf("Lookup(%q) = %v, %v; want ErrInvalidName, 0", host, ttl, err)
		}
	}
	if n := len(s.received()); n != 0 {
		t.Errorf("%d queries sent for invalid names", n)
	}
}

func TestCheckHost(t *testing.T) {
	long := strings.Repeat("a.", 126) + "a" // 253 characters
	label := strings.Repeat("x", 63)
	tests := []struct {
		host, want string
	}{
		{"www.example", "www.example"},
		{"WWW.Example.", "www.example"},
		{"localhost", "localhost"},
		{"_sip._udp.example", "_sip._udp.example"},
		{"a-b.1.example", "a-b.1.example"},
		{long, long},
		{long + ".", long},
		{label + ".example", label + ".example"},
	}
	for _, tt := range tests {
		got, err := checkHost(tt.host)
		if err != nil || got != tt.want {
			t.Errorf("checkHost(%q) = %q, %v; want %q", tt.host, got, err, tt.want)
		}
	}
}

func TestLookupIPLiteral(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	for _, host := range []string{"192.0.2.1", "2001:db8::1", "fe80::1%eth0"} {
		got, ttl, err := r.Lookup(t.Context(), host)
		if err != nil || !slices.Equal(got, addrs(host)) || ttl != DefaultMaxTTL {
			t.Errorf("Lookup(%q) = %v, %v, %v", host, got, ttl, err)
		}
	}
	if n := len(s.received()); n != 0 {
		t.Errorf("%d queries sent for IP literals", n)
	}
}

func TestLookupHostsFile(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	const hosts = `# comment
127.0.0.1	localhost
192.0.2.10  Web.Example web   # canonical name and alias
2001:db8::10 web.example.
192.0.2.11 other.example WEB
192.0.2.10 web.example
not-an-address web.example
192.0.2.12
192.0.2.13 # web.example in a comment
fe80::1%lo www.example
`
	if err := os.WriteFile(r.HostsFile, []byte(hosts), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		host string
		want []netip.Addr
	}{
		{"web.example", addrs("192.0.2.10", "2001:db8::10")},
		{"WEB.EXAMPLE.", addrs("192.0.2.10", "2001:db8::10")},
		{"web", addrs("192.0.2.10", "192.0.2.11")},
		{"localhost", addrs("127.0.0.1")},
		{"www.example", addrs("fe80::1%lo")}, // the hosts file wins over DNS
	}
	for _, tt := range tests {
		got, ttl, err := r.Lookup(t.Context(), tt.host)
		if err != nil || !slices.Equal(got, tt.want) || ttl != HostsTTL {
			t.Errorf("Lookup(%q) = %v, %v, %v; want %v, %v", tt.host, got, ttl, err, tt.want, HostsTTL)
		}
	}
	if n := len(s.received()); n != 0 {
		t.Fatalf("%d queries sent for names in the hosts file", n)
	}

	// Not in the file: DNS.
	got, _, err := r.Lookup(t.Context(), "v4only.example")
	if err != nil || !slices.Equal(got, addrs("192.0.2.3")) {
		t.Errorf("Lookup(v4only.example) = %v, %v", got, err)
	}
	// HostsTTL is clamped too.
	r.MaxTTL = 10 * time.Second
	if _, ttl, _ := r.Lookup(t.Context(), "web"); ttl != r.MaxTTL {
		t.Errorf("hosts TTL %v with MaxTTL %v", ttl, r.MaxTTL)
	}
}

func TestLookupHostsFileMissing(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	r.HostsFile = filepath.Join(t.TempDir(), "absent")
	if got, _, err := r.Lookup(t.Context(), "v4only.example"); err != nil || !slices.Equal(got, addrs("192.0.2.3")) {
		t.Errorf("got %v, %v", got, err)
	}
}

func TestLookupHostsFileUnreadable(t *testing.T) {
	s := startServer(t, good)
	r := newResolver(t, s.addr)
	r.HostsFile = t.TempDir() // a directory: read fails, even as root
	_, ttl, err := r.Lookup(t.Context(), "v4only.example")
	if !IsUnavailable(err) || ttl != DefaultMinTTL {
		t.Errorf("got %v, %v; want ErrUnavailable", ttl, err)
	}
	if n := len(s.received()); n != 0 {
		t.Errorf("%d queries sent", n)
	}
}

func TestServers(t *testing.T) {
	tests := []struct {
		servers []string
		want    []string
		wantErr error
	}{
		{[]string{"127.0.0.1:5353", "127.0.0.2"}, []string{"127.0.0.1:5353", "127.0.0.2:53"}, nil},
		{[]string{"::1", "[::1]:5353", "fe80::1%eth0"}, []string{"[::1]:53", "[::1]:5353", "[fe80::1%eth0]:53"}, nil},
		{[]string{"127.0.0.1", "localhost:53"}, nil, errBadServer},
		{[]string{"[::1]"}, nil, errBadServer},
	}
	for _, tt := range tests {
		r := &Resolver{Servers: tt.servers}
		got, err := r.servers()
		if !errors.Is(err, tt.wantErr) || !slices.Equal(got, tt.want) {
			t.Errorf("servers(%q) = %q, %v; want %q, %v", tt.servers, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestLookupBadServer(t *testing.T) {
	r := newResolver(t, "dns.example:53")
	_, ttl, err := r.Lookup(t.Context(), "www.example")
	if !errors.Is(err, errBadServer) || IsUnavailable(err) || ttl != 0 {
		t.Errorf("got %v, %v", ttl, err)
	}
}

func TestParseResolvConf(t *testing.T) {
	tests := []struct {
		name, conf string
		want       []string
	}{
		{"empty", "", defaultServers},
		{"no nameserver", "search corp.example\noptions ndots:2\n", defaultServers},
		{"IPv4 and IPv6", "nameserver 192.0.2.53\nnameserver 2001:db8::53\n", []string{"192.0.2.53:53", "[2001:db8::53]:53"}},
		{"zone", "nameserver fe80::1%eth0", []string{"[fe80::1%eth0]:53"}},
		{
			"comments, blanks, tabs and junk",
			"# nameserver 192.0.2.1\n; nameserver 192.0.2.2\n\n\tnameserver\t192.0.2.3  # local\nnameserver dns.example\nnameserver\nnameservers 192.0.2.4\nnameserver 192.0.2.5;x\n",
			[]string{"192.0.2.3:53", "192.0.2.5:53"},
		},
		{"at most three", "nameserver 192.0.2.1\nnameserver 192.0.2.2\nnameserver 192.0.2.3\nnameserver 192.0.2.4\n", []string{"192.0.2.1:53", "192.0.2.2:53", "192.0.2.3:53"}},
	}
	for _, tt := range tests {
		if got := parseResolvConf([]byte(tt.conf)); !slices.Equal(got, tt.want) {
			t.Errorf("%s: got %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestDefaults(t *testing.T) {
	var r Resolver
	if r.timeout() != 2*time.Second || r.minTTL() != 5*time.Second || r.maxTTL() != time.Hour {
		t.Errorf("zero Resolver: timeout %v, TTLs [%v, %v]", r.timeout(), r.minTTL(), r.maxTTL())
	}
	tests := []struct {
		r    Resolver
		ttl  time.Duration
		want time.Duration
	}{
		{Resolver{}, 0, 5 * time.Second},
		{Resolver{}, 30 * time.Second, 30 * time.Second},
		{Resolver{}, 24 * time.Hour, time.Hour},
		{Resolver{MinTTL: time.Minute}, time.Second, time.Minute},
		{Resolver{MaxTTL: time.Minute}, time.Hour, time.Minute},
		{Resolver{MaxTTL: time.Second}, 0, time.Second}, // MinTTL > MaxTTL: MaxTTL wins
		{Resolver{MinTTL: -1, MaxTTL: -1}, 0, 5 * time.Second},
	}
	for _, tt := range tests {
		if got := tt.r.clamp(tt.ttl); got != tt.want {
			t.Errorf("%+v clamp(%v) = %v, want %v", tt.r, tt.ttl, got, tt.want)
		}
	}
}

func TestErrors(t *testing.T) {
	cause := errors.New("cause")
	unavailable := error(&UnavailableError{Host: "h", Err: cause})
	notFound := error(&NotFoundError{Host: "h", NXDomain: true})
	if !IsUnavailable(unavailable) || IsNotFound(unavailable) || !errors.Is(unavailable, cause) {
		t.Errorf("UnavailableError: %v", unavailable)
	}
	if !IsNotFound(notFound) || IsUnavailable(notFound) {
		t.Errorf("NotFoundError: %v", notFound)
	}
	partial := &PartialError{Host: "h", IPv6: true, Err: cause}
	if !errors.Is(partial, ErrPartial) || IsUnavailable(partial) || !errors.Is(partial, cause) ||
		!partial.Unanswered(netip.MustParseAddr("2001:db8::1")) || partial.Unanswered(netip.MustParseAddr("192.0.2.1")) {
		t.Errorf("PartialError: %v", partial)
	}
	for err, want := range map[error]string{
		unavailable:               "lookup h: dns unavailable: cause",
		partial:                   "lookup h: no answer for AAAA: cause",
		notFound:                  "lookup h: no such host",
		&NotFoundError{Host: "h"}: "lookup h: no addresses",
		rcodeError(dnsmessage.RCodeServerFailure): "server replied SERVFAIL",
		rcodeError(9): "server replied rcode 9",
	} {
		if err.Error() != want {
			t.Errorf("%q, want %q", err, want)
		}
	}
}
