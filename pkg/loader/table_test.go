package loader

import (
	"errors"
	"fmt"
	"maps"
	"math/bits"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/egressd/egressd/pkg/kernelrule"
)

func prefixes(ps ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ps))
	for i, p := range ps {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

// tableWith returns a table of size slots holding rules, planned and
// committed as the loader would.
func tableWith(t *testing.T, size int, rules ...Rule) *table {
	t.Helper()
	tb := newTable(size, keysPerRule*size)
	for i := range size {
		tb.free = append(tb.free, uint32(i))
	}
	p, err := tb.plan(rules, nil)
	if err != nil {
		t.Fatal(err)
	}
	tb.commit(&p)
	return tb
}

func keyOf(p string, port uint16) ruleKey {
	return ruleKey{dest: kernelrule.Mapped(netip.MustParsePrefix(p)), port: port}
}

// The writes of a plan: keys that stop matching go, new ones come, fresh
// slots start at zero, metadata is written only when it changes, and every
// changed slot's rule is written.
func TestPlanWrites(t *testing.T) {
	base := []Rule{
		{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1},
		{Name: "b", Dests: prefixes("10.1.0.0/16", "10.2.0.0/16"), Limit: 2},
		{Name: "c", Dests: prefixes("10.3.0.0/16"), Port: 80, Limit: 3},
	}
	tests := []struct {
		name    string
		rules   []Rule
		gone    []string
		delKeys []ruleKey
		putKeys []keyPut
		fresh   []uint32
		metas   []uint32
		rules2  []uint32
		hints   bool
	}{
		{
			name:   "a limit alone",
			rules:  []Rule{{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 7}},
			rules2: []uint32{0},
		},
		{
			name:    "new destinations",
			rules:   []Rule{{Name: "b", Dests: prefixes("10.2.0.0/16", "10.9.0.0/16"), Limit: 2}},
			delKeys: []ruleKey{keyOf("10.1.0.0/16", 0)},
			putKeys: []keyPut{{keyOf("10.9.0.0/16", 0), 1}},
			rules2:  []uint32{1},
			hints:   true,
		},
		{
			name:    "a destination moves to a new rule",
			rules:   []Rule{{Name: "a", Dests: prefixes("10.5.0.0/16"), Limit: 1}, {Name: "d", Dests: prefixes("10.0.0.0/8"), Limit: 4}},
			delKeys: []ruleKey{keyOf("10.0.0.0/8", 0)},
			putKeys: []keyPut{{keyOf("10.5.0.0/16", 0), 0}, {keyOf("10.0.0.0/8", 0), 3}},
			metas:   []uint32{3},
			rules2:  []uint32{0, 3},
			hints:   true,
		},
		{
			name:    "a port change rewrites the metadata",
			rules:   []Rule{{Name: "c", Dests: prefixes("10.3.0.0/16"), Port: 81, Limit: 3}},
			delKeys: []ruleKey{keyOf("10.3.0.0/16", 80)},
			putKeys: []keyPut{{keyOf("10.3.0.0/16", 81), 2}},
			metas:   []uint32{2},
			rules2:  []uint32{2},
			hints:   true,
		},
		{
			name:    "a removal",
			gone:    []string{"b"},
			delKeys: []ruleKey{keyOf("10.1.0.0/16", 0), keyOf("10.2.0.0/16", 0)},
			rules2:  []uint32{1},
			hints:   true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tb := tableWith(t, 8, base...)
			var gone []uint32
			for _, n := range tt.gone {
				gone = append(gone, tb.byName[n])
			}
			p, err := tb.plan(tt.rules, gone)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(p.delKeys, tt.delKeys) || !slices.Equal(p.putKeys, tt.putKeys) || !slices.Equal(p.fresh, tt.fresh) ||
				!slices.Equal(p.metas, tt.metas) || !slices.Equal(p.rules, tt.rules2) || p.hintsChange() != tt.hints {
				t.Errorf("plan: del %v put %v fresh %v metas %v rules %v hints %v", p.delKeys, p.putKeys, p.fresh, p.metas, p.rules, p.hintsChange())
			}
		})
	}
}

// A slot used before starts its counts afresh; one never used is zero.
func TestPlanResetsUsedSlots(t *testing.T) {
	tb := tableWith(t, 3, Rule{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1})
	p := tb.deletion(tb.byName["a"])
	tb.commit(&p)
	p, err := tb.plan([]Rule{{Name: "b", Dests: prefixes("10.1.0.0/16"), Limit: 1}, {Name: "c", Dests: prefixes("10.2.0.0/16"), Limit: 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Free slots in order: 1 and 2 never used, then 0.
	tb.commit(&p)
	p, err = tb.plan([]Rule{{Name: "d", Dests: prefixes("10.3.0.0/16"), Limit: 1}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(p.fresh, []uint32{0}) {
		t.Fatalf("fresh %v, want slot 0, which a used", p.fresh)
	}
}

// A plan that cannot apply whole is refused whole, and planning alone
// changes nothing.
func TestPlanRefusesWhole(t *testing.T) {
	tests := []struct {
		name  string
		rules []Rule
		want  error
	}{
		{"conflict with a rule outside the batch", []Rule{
			{Name: "x", Dests: prefixes("10.9.0.0/16"), Limit: 1},
			{Name: "y", Dests: prefixes("::ffff:10.0.0.0/104"), Limit: 1},
		}, ErrConflict},
		{"conflict with a rule the batch keeps as it is", []Rule{
			{Name: "y", Dests: prefixes("10.0.0.0/8"), Limit: 2},
			{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1},
		}, ErrConflict},
		{"conflict with a rule the batch kept as it is", []Rule{
			{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1},
			{Name: "y", Dests: prefixes("10.0.0.0/8"), Limit: 2},
		}, ErrConflict},
		{"conflict inside the batch", []Rule{
			{Name: "x", Dests: prefixes("10.9.0.0/16"), Limit: 1},
			{Name: "y", Dests: prefixes("10.9.0.0/16"), Limit: 1},
		}, ErrConflict},
		{"full", []Rule{
			{Name: "x", Dests: prefixes("10.7.0.0/16"), Limit: 1},
			{Name: "y", Dests: prefixes("10.8.0.0/16"), Limit: 1},
			{Name: "z", Dests: prefixes("10.9.0.0/16"), Limit: 1},
		}, ErrFull},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tb := tableWith(t, 3, Rule{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1})
			before := tb.rules()
			free := slices.Clone(tb.free)
			if _, err := tb.plan(tt.rules, nil); !errors.Is(err, tt.want) {
				t.Fatalf("plan: %v, want %v", err, tt.want)
			}
			if !slices.EqualFunc(tb.rules(), before, rulesEqual) || !slices.Equal(tb.free, free) {
				t.Fatalf("planning changed the table: %v", tb.rules())
			}
		})
	}
}

func rulesEqual(a, b Rule) bool {
	return a.Name == b.Name && a.Limit == b.Limit && slices.Equal(a.Dests, b.Dests) && a.Port == b.Port && a.Scope == b.Scope
}

// Committing a plan makes the table what a table built from the result
// would be: names, keys, free slots, generations and the lookup hints.
func TestCommit(t *testing.T) {
	scope := Scope{CgroupID: 42, Level: 2}
	tb := tableWith(t, 4,
		Rule{Name: "a", Dests: prefixes("10.0.0.0/8"), Limit: 1},
		Rule{Name: "b", Dests: prefixes("10.1.0.0/16"), Port: 443, Scope: scope, Limit: 1, Requests: true},
	)
	p, err := tb.plan([]Rule{{Name: "c", Dests: prefixes("10.2.0.0/16"), Port: 80, Limit: 1}}, []uint32{tb.byName["b"]})
	if err != nil {
		t.Fatal(err)
	}
	tb.commit(&p)
	if _, ok := tb.byName["b"]; ok || tb.byName["c"] != 2 || tb.byKey[keyOf("10.2.0.0/16", 80)] != 2 || len(tb.byKey) != 2 {
		t.Fatalf("names %v keys %v", tb.byName, tb.byKey)
	}
	if !slices.Equal(tb.free, []uint32{3, 1}) || tb.nextGen != 4 || tb.slots[1].active || tb.slots[1].gen != 2 {
		t.Fatalf("free %v next gen %d slot 1 %+v", tb.free, tb.nextGen, tb.slots[1])
	}
	want := newUses()
	for _, r := range tb.rules() {
		want.add(&r, ruleKeys(&r), 1)
	}
	if got := tb.uses.hints(); got.classes != want.hints().classes || got.levels != 0 || len(got.scopes) != 0 ||
		got.ports != want.hints().ports || tb.uses.requests != 0 {
		t.Fatalf("hints %+v, want %+v", got, want.hints())
	}
	prefixBits := uint32(1<<classBit(classHostAny, false) | 1<<classBit(classHostPort, false))
	if h := tb.uses.hints(); h.classes != prefixBits || h.ports[0][80/64] != 1<<(80%64) || h.ports[0][443/64] != 0 || h.ports[1] != ([65536 / 64]uint64{}) {
		t.Fatalf("hints %+v", h)
	}
	if tb.uses.exact != 0 || tb.uses.prefixes != 2 {
		t.Fatalf("%d exact keys and %d prefixes, want 0 and 2", tb.uses.exact, tb.uses.prefixes)
	}
}

// After any sequence of whole-set changes (Sync's plans: rules added,
// removed, moved to other keys, keys passed between rules, limits
// changed), with rules deleted one by one between them (Delete's plans),
// the name and key indexes are what the active slots give, the free slots
// are the inactive ones, and each whole-set plan deleted exactly the slots
// of the names the rules left out.
func TestCommitKeepsIndexes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tb := tableWith(t, 64)
	for step := range 500 {
		// A rule's keys are drawn from a small pool, so that keys pass
		// between rules; rules the draw makes conflict are left out.
		var rules []Rule
		claimed := map[ruleKey]bool{}
		for i := range 48 {
			if rng.IntN(4) == 0 {
				continue
			}
			r := Rule{Name: fmt.Sprint("r", i), Limit: 1 + rng.Uint32N(3), Port: uint16(rng.IntN(2) * 80)}
			for range 1 + rng.IntN(3) {
				d := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(16)), 0}), 24+8*rng.IntN(2))
				if !slices.Contains(r.Dests, d) {
					r.Dests = append(r.Dests, d)
				}
			}
			keys := ruleKeys(&r)
			if slices.ContainsFunc(keys, func(k ruleKey) bool { return claimed[k] }) {
				continue
			}
			for _, k := range keys {
				claimed[k] = true
			}
			rules = append(rules, r)
		}
		keep := map[string]bool{}
		for _, r := range rules {
			keep[r.Name] = true
		}
		var gone []uint32
		for name, idx := range tb.byName {
			if !keep[name] {
				gone = append(gone, idx)
			}
		}
		slices.Sort(gone)
		p, err := tb.replacing(rules)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		var removed []uint32
		for _, c := range p.changes {
			if c.old.active && !c.new.active {
				removed = append(removed, c.idx)
			}
		}
		if !slices.Equal(removed, gone) {
			t.Fatalf("step %d: plan deletes slots %v, want %v", step, removed, gone)
		}
		tb.commit(&p)
		names, keys := map[string]uint32{}, map[ruleKey]uint32{}
		for i, s := range tb.slots {
			if s.active {
				names[s.rule.Name] = uint32(i)
				for _, k := range ruleKeys(&s.rule) {
					keys[k] = uint32(i)
				}
			}
		}
		if !maps.Equal(tb.byName, names) || !maps.Equal(tb.byKey, keys) {
			t.Fatalf("step %d: names %v keys %v, the slots give %v and %v", step, tb.byName, tb.byKey, names, keys)
		}
		if len(names) != len(rules) {
			t.Fatalf("step %d: %d rules active, want %d", step, len(names), len(rules))
		}
		if len(rules) > 0 && rng.IntN(2) == 0 {
			// A rule deleted by itself: its slot is freed, its name kept
			// there, and the next whole-set plan may list it where the
			// last one did.
			r := rules[rng.IntN(len(rules))]
			d := tb.deletion(tb.byName[r.Name])
			tb.commit(&d)
		}
		var free []uint32
		for i, s := range tb.slots {
			if !s.active {
				free = append(free, uint32(i))
			}
		}
		if got := slices.Sorted(slices.Values(tb.free)); !slices.Equal(got, free) {
			t.Fatalf("step %d: free slots %v, the inactive ones are %v", step, got, free)
		}
	}
}

// SlotsFor is the fewest slots whose tables hold the rules: planned into
// tables of that size they fit, into one slot fewer they do not.
func TestSlotsFor(t *testing.T) {
	addrs := func(n int, v6 bool) []netip.Prefix {
		out := make([]netip.Prefix, n)
		for i := range out {
			a := netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)})
			if v6 {
				b := netip.MustParseAddr("2001:db8::").As16()
				b[14], b[15] = byte(i>>8), byte(i)
				a = netip.AddrFrom16(b)
			}
			out[i] = netip.PrefixFrom(a, a.BitLen())
		}
		return out
	}
	tests := []struct {
		name  string
		rules []Rule
		want  int
	}{
		{"a slot a rule", []Rule{
			{Name: "a", Dests: prefixes("10.0.0.1/32"), Limit: 1},
			{Name: "b", Dests: prefixes("10.0.0.0/8"), Limit: 1},
			{Name: "c", Dests: prefixes("10.1.0.0/16", "10.2.0.1/32"), Limit: 1},
		}, 3},
		{"a host name of 256 addresses", []Rule{
			{Name: "cdn", Dests: addrs(256, false), Limit: 1},
			{Name: "b", Dests: prefixes("10.0.0.0/8"), Limit: 1},
		}, 64},
		{"addresses of both families", []Rule{
			{Name: "v4", Dests: addrs(9, false), Limit: 1},
			{Name: "v6", Dests: addrs(9, true), Limit: 1},
		}, 5},
		{"prefixes", []Rule{
			{Name: "p", Dests: prefixes("10.1.0.0/16", "10.2.0.0/16", "10.3.0.0/16", "10.4.0.0/16", "10.5.0.0/16"), Limit: 1},
		}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := SlotsFor(tt.rules)
			if n != tt.want {
				t.Fatalf("SlotsFor = %d, want %d", n, tt.want)
			}
			for size, fits := range map[int]bool{n: true, n - 1: false} {
				if _, err := tableWith(t, size).plan(tt.rules, nil); (err == nil) != fits || (err != nil && !errors.Is(err, ErrFull)) {
					t.Errorf("%d slots: %v, want fits %v", size, err, fits)
				}
			}
		})
	}
}

// TestUDPBuckets: a prefix shorter than a network (an IPv4 /24, an IPv6
// /48) sets the buckets of its addresses, its first 16 bits' for IPv4 and
// its first 32's folded for IPv6 (every one for a prefix shorter than
// them); a longer one sets its network's hashed bit (an IPv4 /17 to /23,
// each of its networks'); a whole address its own hashed bit.
func TestUDPBuckets(t *testing.T) {
	const v6 = 1 << 16
	tests := []struct {
		prefix     string
		buckets    int   // bits set of prefixes
		set, unset []int // some of them, and some not
		hashed     int   // hashed bits set
	}{
		{"::ffff:10.0.0.0/104", 256, []int{0x0a00, 0x0aff}, []int{0x09ff, 0x0b00, v6}, 0},
		{"::ffff:10.1.0.0/112", 1, []int{0x0a01}, []int{0x0a00, 0x0a02}, 0},
		{"::ffff:10.1.16.0/116", 0, nil, []int{0x0a01}, 16},
		{"::ffff:10.1.2.0/120", 0, nil, []int{0x0a01}, 1},
		{"::ffff:10.1.2.128/121", 0, nil, nil, 128},
		{"::ffff:10.1.2.4/126", 0, nil, nil, 4},
		{"2001:db8::80/121", 0, nil, nil, 128},
		{"2001:db8::/120", 0, nil, nil, 1},
		{"::ffff:0.0.0.0/96", 1 << 16, []int{0, 0xffff}, []int{v6, v6 + 0xffff}, 0},
		{"2001:db8::/32", 1, []int{v6 + (0x2001 ^ 0x0db8)}, []int{v6 + 0x2001, 0x2001}, 0},
		{"2001:db8:ff00::/40", 1, []int{v6 + (0x2001 ^ 0x0db8)}, nil, 0},
		{"2001:db8:1::/48", 0, nil, []int{v6 + (0x2001 ^ 0x0db8)}, 1},
		{"2001:db8:1:2::/64", 0, nil, nil, 1},
		{"2001:db8::/20", 1 << 12, []int{v6 + (0x2001 ^ 0x0db8), v6 + (0x2001 ^ 0x0fff), v6 + 0x2001}, []int{v6 + (0x2001 ^ 0x1000)}, 0},
		{"2000::/3", 1 << 16, []int{v6, v6 + 0xffff}, []int{0, 0xffff}, 0},
		{"::/80", 1 << 16, []int{0, 0xffff}, []int{v6}, 1},
		{"::/0", 2 << 16, []int{0, v6 + 0xffff}, nil, 0},
		{"::ffff:127.0.0.1/128", 0, nil, nil, 1},
		{"::1/128", 0, nil, nil, 1},
	}
	for _, tt := range tests {
		var u udpBuckets
		u.add(netip.MustParsePrefix(tt.prefix))
		if n, hashed := popcount(u[:udpPrefixBits/64]), popcount(u[udpPrefixBits/64:]); n != tt.buckets || hashed != tt.hashed {
			t.Errorf("%s: %d buckets and %d hashed bits set, want %d and %d", tt.prefix, n, hashed, tt.buckets, tt.hashed)
		}
		for _, b := range tt.set {
			if u[b/64]>>(b%64)&1 == 0 {
				t.Errorf("%s: bucket %#x not set", tt.prefix, b)
			}
		}
		for _, b := range tt.unset {
			if u[b/64]>>(b%64)&1 != 0 {
				t.Errorf("%s: bucket %#x set", tt.prefix, b)
			}
		}
	}
	// A network is one bit, whatever prefix of it a rule names.
	var net, sub udpBuckets
	net.add(netip.MustParsePrefix("2001:db8:1::/48"))
	sub.add(netip.MustParsePrefix("2001:db8:1:2::/64"))
	if net != sub {
		t.Error("2001:db8:1:2::/64 sets another bit than its /48")
	}
	// A prefix of 128 addresses or fewer sets theirs, not its network's: a
	// send to the rest of the network finds its bits clear.
	var net4, half udpBuckets
	net4.add(netip.MustParsePrefix("::ffff:10.1.2.0/120"))
	half.add(netip.MustParsePrefix("::ffff:10.1.2.128/121"))
	for i := range net4 {
		if net4[i]&half[i] != 0 {
			t.Fatalf("10.1.2.128/25 sets a bit of its /24's: word %d", i)
		}
	}
}

func popcount(words []uint64) int {
	n := 0
	for _, w := range words {
		n += bits.OnesCount64(w)
	}
	return n
}
