package policy

import (
	"errors"
	"net/netip"
	"reflect"
	"testing"

	"github.com/egressd/egressd/pkg/kernelrule"
)

// FuzzParse holds Parse to what the daemon relies on, for any input: it
// never panics; a refusal is an [*Error] with at least one problem; and a
// policy it accepts validates, survives Format and Parse unchanged, and
// gives one kernel rule per rule, named as the rule, that the loader accepts
// once it has a destination.
//
//	go test -run '^$' -fuzz FuzzParse -fuzztime 60s ./pkg/policy/
func FuzzParse(f *testing.F) {
	seeds := []string{
		example,
		"",
		"rules: []\n",
		"rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n",
		"rules:\n  - {name: a, destination: db.internal, port: 5432, unit: a@b.service, perWindow: {permits: 9, window: 90ms, segments: 3}, errno: EAGAIN}\n",
		"rules:\n  - {name: a, destination: \"::ffff:10.0.0.0/104\", cgroup: /a/b, adaptive: {minimum: 1, maximum: 9, initial: 3, multiple: 1.5, decreaseFactor: 0.5, samples: request}, shadow: true}\n",
		"rules:\n  - &r {name: a, destination: 10.0.0.1, perSecond: &p {permits: 1}}\n  - *r\n  - {name: b, destination: 10.0.0.2, perSecond: *p}\n",
		"rules:\n  - {name: a, destination: 10.20.1.0/16, port: 0, concurrency: 0, perSecond: {}}\n  - x\nfoo: 1\n---\n",
		"rules:\n  - {name: \"a\\tb\", destination: \"fe80::1%eth0\", unit: \"\", adaptive: {multiple: .nan}}\n",
		"\n\nrules: x: y\n",
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	// One name's answer: three addresses, one of them written twice.
	addrs := []netip.Addr{
		netip.MustParseAddr("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff"),
		netip.MustParseAddr("192.0.2.1"),
		netip.MustParseAddr("::ffff:192.0.2.1"),
		netip.MustParseAddr("fe80::1%eth0"),
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data)
		if err != nil {
			e, ok := errors.AsType[*Error](err)
			if !ok || len(e.Problems) == 0 || !errors.Is(err, ErrInvalid) || p != nil {
				t.Fatalf("Parse refused with %#v (policy %v)", err, p)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("Parse accepted a policy Validate refuses: %v", err)
		}
		out, err := Format(p)
		if err != nil {
			t.Fatalf("Format: %v", err)
		}
		again, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse(Format(p)): %v\n%s", err, out)
		}
		if !reflect.DeepEqual(again, p) {
			t.Fatalf("Parse(Format(p)) = %+v, want %+v\n%s", again, p, out)
		}
		for _, r := range p.Rules {
			_, isHost := r.Destination.Host()
			kr := r.LoaderRule(kernelrule.Scope{}, addrs)
			if kr.Name != r.Name {
				t.Fatalf("kernel rule of %q is named %q", r.Name, kr.Name)
			}
			if isHost && len(kr.Dests) != 3 || !isHost && len(kr.Dests) != 1 {
				t.Fatalf("kernel rule of %+v has Dests %v", r, kr.Dests)
			}
			if err := kr.Validate(); err != nil {
				t.Fatalf("the loader refuses the kernel rule of %+v: %v", r, err)
			}
			unresolved := r.LoaderRule(kernelrule.Scope{}, nil)
			if isHost && (len(unresolved.Dests) != 0 || unresolved.Validate() == nil) {
				t.Fatalf("kernel rule of unresolved %+v: Dests %v, loader accepts it", r, unresolved.Dests)
			}
			if !isHost && !reflect.DeepEqual(unresolved, kr) {
				t.Fatalf("kernel rule of %+v depends on addresses it should ignore", r)
			}
		}
	})
}
