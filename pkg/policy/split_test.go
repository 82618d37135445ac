package policy

import (
	"reflect"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// splitCases are policies of several rules in the styles people write,
// and in the styles a split by lines could get wrong; split says whether
// parseSplit reads them in pieces (the others it leaves to parseWhole).
var splitCases = []struct {
	name  string
	text  string
	split bool
}{
	{"flow items", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, port: 80, perSecond: {permits: 5}}
  - {name: c, destination: db.internal, adaptive: {maximum: 90}}
`, true},
	{"block items, comments, maxRules first", `# egressd policy
maxRules: 10
rules: # the list
  # the database
  - name: a
    destination: 10.0.0.1
    concurrency: 1

  - name: b   # trailing
    destination: 10.0.0.0/8
    perWindow:
      permits: 5
      window: 1s
# a comment at the first column, inside the list
  - name: c
    destination: "::1"
    shared: {redis: "redis://127.0.0.1:6379", key: k}
    perSecond:
      permits: 5
`, true},
	{"list at the first column, maxRules and metrics after", `rules:
- {name: a, destination: 10.0.0.1, concurrency: 1}
- name: b
  destination: 10.0.0.2
  concurrency: 2
maxRules: 5
metrics:
  rules: [a, "b*"]
`, true},
	{"no newline at the end", "rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n  - {name: b, destination: 10.0.0.2, concurrency: 1}", true},

	{"an item line inside a quoted value", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, errno: "EPERM
  - x"}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"an item line inside a flow value", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1, perSecond: [
  - x]}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"an anchor used in a later piece", `rules:
  - &r {name: a, destination: 10.0.0.1, concurrency: 1}
  - *r
`, false},
	{"an anchor of the top level used in the list", `maxRules: &m 3
rules:
  - {name: a, destination: 10.0.0.1, concurrency: *m}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"an item's value on the next line", `rules:
  -
    {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"a line at the items' indentation that starts none", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  x: 1
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"rules twice", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
rules:
  - {name: c, destination: 10.0.0.3, concurrency: 1}
`, false},
	{"rules twice, the second quoted", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
"rules": []
`, false},
	{"a second document", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
---
rules: []
`, false},
	{"a tab", "rules:\n  - {name: a, destination: 10.0.0.1,\tconcurrency: 1}\n  - {name: b, destination: 10.0.0.2, concurrency: 1}\n", false},
	{"carriage returns", "rules:\r\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\r\n  - {name: b, destination: 10.0.0.2, concurrency: 1}\r\n", false},
	{"a flow list", "rules: [{name: a, destination: 10.0.0.1, concurrency: 1}, {name: b, destination: 10.0.0.2, concurrency: 1}]\n", false},
	{"one name twice, in two pieces", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: a, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"a problem in one piece", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 0}
`, false},
	{"a shared mapping with nothing set", `rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1, shared: {}}
`, false},
	{"more rules than maxRules", `maxRules: 1
rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
`, false},
	{"rules: inside a quoted value of the top level", `maxRules: "1
rules:
  - {name: a, destination: 10.0.0.1, concurrency: 1}
  - {name: b, destination: 10.0.0.2, concurrency: 1}
"
`, false},
}

func TestSplit(t *testing.T) {
	for _, tc := range splitCases {
		t.Run(tc.name, func(t *testing.T) {
			whole, wholeErr := parseWhole([]byte(tc.text))
			for _, per := range []int{1, 2} {
				p, ok := parseSplit([]byte(tc.text), per, nil)
				if ok != tc.split && per == 1 {
					t.Errorf("parseSplit(%d) ok = %v, want %v", per, ok, tc.split)
				}
				if ok && (wholeErr != nil || !reflect.DeepEqual(p, whole)) {
					t.Errorf("parseSplit(%d) = %+v; parseWhole = %+v, %v", per, p, whole, wholeErr)
				}
			}
			// What Parse answers does not depend on the way.
			p, err := Parse([]byte(tc.text))
			if !reflect.DeepEqual(p, whole) || errString(err) != errString(wholeErr) {
				t.Errorf("Parse = %+v, %v; parseWhole = %+v, %v", p, err, whole, wholeErr)
			}
		})
	}
}

// TestSplitLarge: Parse reads a large policy in pieces, to the same
// policy as in one, and a problem in it is reported with its line.
func TestSplitLarge(t *testing.T) {
	data := manyRules(3 * splitMin)
	per := splitPiece(data)
	if per == 0 {
		t.Fatalf("splitPiece(%d rules) = 0", 3*splitMin)
	}
	p, ok := parseSplit(data, per, nil)
	whole, err := parseWhole(data)
	if !ok || err != nil || !reflect.DeepEqual(p, whole) {
		t.Fatalf("parseSplit ok %v; parseWhole err %v; equal %v", ok, err, reflect.DeepEqual(p, whole))
	}
	bad := strings.Replace(string(data), "{name: r5000, ", "{name: r5000, port: 0, ", 1)
	_, err = Parse([]byte(bad))
	if err == nil || !strings.Contains(err.Error(), "line 5002") {
		t.Fatalf("Parse of a large policy with a bad port at line 5002: %v", err)
	}
}

// TestSize: Size reads from a large policy the count of its rules and its
// maxRules, as Parse would give them, and declines a small policy, one it
// cannot cut by lines, and one whose top level has a problem.
func TestSize(t *testing.T) {
	large := string(manyRules(3 * splitMin))
	for _, tc := range []struct {
		name            string
		text            string
		rules, maxRules int
		ok              bool
	}{
		{"large", large, 3 * splitMin, 0, true},
		{"with maxRules after the rules", large + "maxRules: 9000\n", 3 * splitMin, 9000, true},
		{"with maxRules before the rules", "maxRules: 8000\n" + large, 3 * splitMin, 8000, true},
		{"small", "rules:\n  - {name: a, destination: 10.0.0.1, concurrency: 1}\n", 0, 0, false},
		{"a tab", strings.Replace(large, "  - {name: r7,", "\t- {name: r7,", 1), 0, 0, false},
		{"a bad maxRules", "maxRules: lots\n" + large, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rules, maxRules, ok := Size([]byte(tc.text))
			if rules != tc.rules || maxRules != tc.maxRules || ok != tc.ok {
				t.Fatalf("Size = %d, %d, %v; want %d, %d, %v", rules, maxRules, ok, tc.rules, tc.maxRules, tc.ok)
			}
			if !ok {
				return
			}
			p, err := Parse([]byte(tc.text))
			if err != nil || len(p.Rules) != rules || p.MaxRules != maxRules {
				t.Fatalf("Parse: %v; Size = %d, %d", err, rules, maxRules)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// FuzzSplit holds parseSplit to parseWhole: whatever it reads in pieces,
// it reads as parseWhole does.
//
//	go test -run '^$' -fuzz FuzzSplit -fuzztime 60s ./pkg/policy/
func FuzzSplit(f *testing.F) {
	for _, tc := range splitCases {
		f.Add([]byte(tc.text))
	}
	f.Add([]byte(example))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, per := range []int{1, 2, 3} {
			p, ok := parseSplit(data, per, nil)
			if !ok {
				continue
			}
			whole, err := parseWhole(data)
			if err != nil || !reflect.DeepEqual(p, whole) {
				t.Fatalf("parseSplit(%d) = %+v; parseWhole = %+v, %v", per, p, whole, err)
			}
		}
	})
}

// plainDecimal reads what the YAML decoder reads, or leaves it to it.
func TestPlainDecimal(t *testing.T) {
	for _, tc := range []struct {
		in   string
		read bool // by plainDecimal, not left to the decoder
	}{
		{"0", true}, {"7", true}, {"-7", true}, {"65535", true}, {"123456789012345678", true},
		{"-0", true}, {"017", false}, {"0x1f", false}, {"0o17", false}, {"1_000", false}, {"+5", false},
		{"", false}, {"-", false}, {"1e3", false}, {"12a", false}, {"1234567890123456789", false},
	} {
		got, ok := plainDecimal(tc.in)
		if ok != tc.read {
			t.Errorf("plainDecimal(%q) ok = %v, want %v", tc.in, ok, tc.read)
		}
		var want int
		if err := yaml.Unmarshal([]byte(tc.in), &want); ok && (err != nil || got != want) {
			t.Errorf("plainDecimal(%q) = %d; the YAML decoder: %d, %v", tc.in, got, want, err)
		}
	}
}
