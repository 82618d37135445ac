package policy

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// TestReader: a Reader reads a policy after each kind of edit as Parse
// does, parsing again only the pieces the edit touched.
func TestReader(t *testing.T) {
	base := manyRules(6 * splitMin)
	var r Reader
	if _, err := r.Parse(base); err != nil {
		t.Fatal(err)
	}
	all := r.cache.parsed
	if all < 6 {
		t.Fatalf("a policy of %d rules was read in %d pieces", 6*splitMin, all)
	}
	rule := func(i int) string {
		return fmt.Sprintf("  - {name: r%d, destination: 10.%d.%d.%d, port: %d, concurrency: 100}\n", i, i>>16&255, i>>8&255, i&255, 1+i%2000)
	}
	for _, tc := range []struct {
		name   string
		edit   func(string) string
		parsed int // the most pieces it may parse; -1: all
	}{
		{"unchanged", func(s string) string { return s }, 0},
		{"a rule changed in the middle", func(s string) string {
			return strings.Replace(s, rule(5000), strings.Replace(rule(5000), "100}", "7}", 1), 1)
		}, 2},
		{"a rule added first", func(s string) string {
			return strings.Replace(s, "rules:\n", "rules:\n  - {name: first, destination: 10.200.0.1, concurrency: 1}\n", 1)
		}, 2},
		{"a rule removed in the middle", func(s string) string { return strings.Replace(s, rule(7000), "", 1) }, 2},
		{"a rule added last", func(s string) string {
			return s + "  - {name: last, destination: 10.200.0.2, concurrency: 1}\n"
		}, 2},
		{"a comment added in the middle", func(s string) string {
			return strings.Replace(s, rule(9000), "  # the nine thousandth\n"+rule(9000), 1)
		}, 2},
		{"the top level changed", func(s string) string { return "maxRules: 20000\n" + s }, 0},
		{"every rule changed", func(s string) string { return strings.ReplaceAll(s, "100}", "99}") }, -1},
		{"a problem", func(s string) string {
			return strings.Replace(s, rule(3000), strings.Replace(rule(3000), "100}", "0}", 1), 1)
		}, -1},
		{"a name twice", func(s string) string { return strings.Replace(s, rule(3000), rule(3000)+rule(3000), 1) }, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := r.Parse(base); err != nil {
				t.Fatal(err)
			}
			data := []byte(tc.edit(string(base)))
			want, wantErr := Parse(data)
			got, err := r.Parse(data)
			if !reflect.DeepEqual(got, want) || errString(err) != errString(wantErr) {
				t.Fatalf("Reader: %d rules, %v; Parse: %d rules, %v", rulesOf(got), err, rulesOf(want), wantErr)
			}
			if pieces := len(r.cache.rules); err == nil && (tc.parsed >= 0 && r.cache.parsed > tc.parsed || tc.parsed < 0 && r.cache.parsed < pieces) {
				t.Fatalf("parsed %d pieces of %d; want at most %d (-1: all)", r.cache.parsed, pieces, tc.parsed)
			}
		})
	}
	// A policy with a problem, the last read, left the pieces as they were.
	if _, err := r.Parse(base); err != nil || r.cache.parsed != 0 {
		t.Fatalf("base after a problem: parsed %d pieces, %v", r.cache.parsed, err)
	}
	// A small policy, read in one piece, lets them go.
	if _, err := r.Parse([]byte("rules:\n" + rule(1))); err != nil || r.cache.rules != nil {
		t.Fatalf("after a small policy: %d pieces kept, %v", len(r.cache.rules), err)
	}
}

func rulesOf(p *Policy) int {
	if p == nil {
		return -1
	}
	return len(p.Rules)
}

// FuzzReader holds a read in pieces some of which the previous read kept
// to parseWhole, whatever the two texts.
//
//	go test -run '^$' -fuzz FuzzReader -fuzztime 60s ./pkg/policy/
func FuzzReader(f *testing.F) {
	for i, a := range splitCases {
		b := splitCases[(i+1)%len(splitCases)]
		f.Add([]byte(a.text), []byte(b.text))
		f.Add([]byte(a.text), []byte(strings.Replace(a.text, "name: a", "name: z", 1)))
	}
	f.Add([]byte(example), bytes.Replace([]byte(example), []byte("50"), []byte("51"), 1))
	f.Fuzz(func(t *testing.T, before, after []byte) {
		for _, per := range []int{1, 2, 3} {
			var c pieceCache
			parseSplit(before, per, &c)
			p, ok := parseSplit(after, per, &c)
			if !ok {
				continue
			}
			whole, err := parseWhole(after)
			if err != nil || !reflect.DeepEqual(p, whole) {
				t.Fatalf("parseSplit(%d) after %q = %+v; parseWhole = %+v, %v", per, before, p, whole, err)
			}
		}
	})
}
