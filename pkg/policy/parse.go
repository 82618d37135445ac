package policy

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/kernelrule"
	"go.yaml.in/yaml/v3"
)

// Load reads and parses the policy file at path. Its problems name the file.
func Load(path string) (*Policy, error) { return load(path, nil) }

// Parse reads a policy file. It returns every problem at once, as an
// [*Error] sorted by position; a policy it returns passes [Policy.Validate].
func Parse(data []byte) (*Policy, error) { return parse(data, nil) }

// A Reader reads policy files as [Load] and [Parse] do, and keeps the rules
// of the last large policy it read: reading the file again after an edit
// parses only the rules near each change (a few thousand at most) and takes
// the others as they were, which for a file of 100,000 rules is most of the
// time a reload takes. The rules of the last policy a Reader returned stay
// shared with it: they must not be changed in place. The zero Reader is
// ready; it is safe for concurrent use.
type Reader struct {
	mu    sync.Mutex
	cache pieceCache
}

// Load is [Load], keeping what it read for the next read.
func (r *Reader) Load(path string) (*Policy, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return load(path, &r.cache)
}

// Parse is [Parse], keeping what it read for the next read.
func (r *Reader) Parse(data []byte) (*Policy, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return parse(data, &r.cache)
}

func load(path string, c *pieceCache) (*Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	p, err := parse(data, c)
	if e, ok := errors.AsType[*Error](err); ok {
		e.File = path
	}
	return p, err
}

func parse(data []byte, c *pieceCache) (*Policy, error) {
	if p, ok := parseSplit(data, splitPiece(data), c); ok {
		return p, nil
	}
	p, err := parseWhole(data)
	if err == nil && c != nil {
		// What c holds is of a policy no longer in force: let it go.
		*c = pieceCache{}
	}
	return p, err
}

// parseWhole parses data in one piece.
func parseWhole(data []byte) (*Policy, error) {
	var d decoder
	rules, wheres := d.document(data)
	problems := append(d.problems, check(rules, wheres)...)
	problems = append(problems, checkCapacity(len(rules), d.maxRules, d.maxRulesAt)...)
	if len(problems) > 0 {
		slices.SortStableFunc(problems, func(a, b Problem) int {
			return cmp.Or(cmp.Compare(a.Line, b.Line), cmp.Compare(a.Column, b.Column))
		})
		return nil, &Error{Problems: problems}
	}
	return &Policy{Rules: rules, MaxRules: d.maxRules, MetricsRules: d.metricsRules}, nil
}

// decoder turns YAML nodes into rules, collecting the problems of form —
// unknown fields, wrong types, two limits — that leave no value to check.
type decoder struct {
	problems   []Problem
	maxRules   int
	maxRulesAt *yaml.Node
	// metricsRules are metrics.rules's patterns.
	metricsRules []string
	draft        draft
}

const (
	strTag   = "!!str"
	intTag   = "!!int"
	floatTag = "!!float"
	boolTag  = "!!bool"
	nullTag  = "!!null"
)

func (d *decoder) document(data []byte) ([]Rule, []*where) {
	if root := d.root(data); root != nil {
		return d.top(root)
	}
	return nil, nil
}

// root parses data as one YAML document and returns its root node, nil
// for an empty document or a syntax error (recorded).
func (d *decoder) root(data []byte) *yaml.Node {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if !errors.Is(err, io.EOF) {
			d.syntax(err)
		}
		return nil
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case err == nil:
		d.problems = append(d.problems, Problem{Line: next.Line, Column: next.Column, Msg: "a policy is one YAML document; this is a second"})
	case !errors.Is(err, io.EOF):
		d.syntax(err)
	}
	// An empty document holds a null, as does one that is only "~".
	if len(doc.Content) == 0 || doc.Content[0].ShortTag() == nullTag {
		return nil
	}
	return doc.Content[0]
}

// top decodes the policy's top level.
func (d *decoder) top(root *yaml.Node) ([]Rule, []*where) {
	var rules []Rule
	var wheres []*where
	top := fields{d: d, w: newWhere(nil)}
	top.mapping(root, "", "a policy", []string{"rules", "maxRules", "metrics"}, func(key string, _, v *yaml.Node) {
		switch key {
		case "maxRules":
			d.maxRulesAt = v
			if x, ok := top.integer(key, v, 1, kernelrule.MaxRules); ok {
				if _, msg := notZero[int]("the default")(key, x); msg != "" {
					top.problem(v, key, "%s", msg)
				}
				d.maxRules = x
			}
			return
		case "metrics":
			d.metricsRules = top.metrics(v)
			return
		}
		if v.ShortTag() == nullTag {
			return
		}
		if v.Kind != yaml.SequenceNode {
			top.problem(v, "rules", "rules must be a list")
			return
		}
		if len(v.Content) > 0 {
			rules, wheres = make([]Rule, 0, len(v.Content)), make([]*where, 0, len(v.Content))
		}
		for i, n := range v.Content {
			r, w := d.rule(n, i)
			rules = append(rules, r)
			wheres = append(wheres, w)
		}
	})
	return rules, wheres
}

// metrics decodes the policy's metrics mapping: the names or patterns of
// the rules whose series the metrics keep first.
func (f fields) metrics(v *yaml.Node) []string {
	var names []string
	f.mapping(v, "metrics.", "metrics", []string{"rules"}, func(_ string, _, v *yaml.Node) {
		if v.Kind != yaml.SequenceNode {
			f.problem(v, "metrics.rules", "metrics.rules must be a list of rule names or patterns")
			return
		}
		for _, n := range v.Content {
			if f.alias(n, "metrics.rules") {
				continue
			}
			name, ok := f.str("metrics.rules", n)
			if !ok {
				continue
			}
			if msg := metricsRuleProblem(name); msg != "" {
				f.problem(n, "metrics.rules", "%s", msg)
				continue
			}
			names = append(names, name)
		}
	})
	return names
}

// syntax records a YAML syntax error, with its line when the parser gave
// one ("yaml: line 3: mapping values are not allowed in this context").
func (d *decoder) syntax(err error) {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	var p Problem
	if _, scanErr := fmt.Sscanf(msg, "line %d:", &p.Line); scanErr == nil {
		_, msg, _ = strings.Cut(msg, ": ")
	}
	p.Msg = "YAML: " + msg
	d.problems = append(d.problems, p)
}

func (d *decoder) rule(n *yaml.Node, i int) (Rule, *where) {
	w := newWhere(n)
	var name string
	if n.Kind == yaml.MappingNode {
		for j := 0; j+1 < len(n.Content); j += 2 {
			if k, v := n.Content[j], n.Content[j+1]; k.Kind == yaml.ScalarNode && k.Value == "name" && v.Kind == yaml.ScalarNode && v.ShortTag() == strTag {
				name = v.Value
				break
			}
		}
	}
	f := fields{d: d, rule: label(name, i), w: w}
	// One draft for every rule the decoder reads: a draft each would be
	// as many allocations as a policy has rules.
	d.draft = draft{}
	if !f.decode(n, "", "a rule", &d.draft) {
		// Said once; "name is missing" and the rest would only repeat it.
		for _, path := range []string{"name", "destination", "limit"} {
			w.refuse(path)
		}
	}
	r := d.draft.rule(w)
	// A shared mapping with every field left out or zero would read as no
	// sharing at all: a fleet's budget, its redis an unset variable of a
	// template, would silently be each host's own.
	if w.node("shared") != nil && !w.bad["shared"] && !r.IsShared() {
		checker{w: w, rule: f.rule, problems: &d.problems}.checkShared(r)
	}
	return r, w
}

// decode reads n, the mapping of the fields whose paths start with prefix
// ("" for a rule's own), into dr. It reports whether n was a mapping.
func (f fields) decode(n *yaml.Node, prefix, what string, dr *draft) bool {
	return f.mapping(n, prefix, what, keysUnder[prefix], func(key string, k, v *yaml.Node) {
		field := fieldAt[prefix+key]
		if field.limit != nil {
			if msg := dr.choose(field.Path); msg != "" {
				f.problem(k, "", "%s", msg)
				return
			}
		}
		if field.value.decode == nil {
			if !f.decode(v, field.Path+".", key, dr) && field.limit != nil {
				dr.unread = true
			}
			return
		}
		field.value.decode(f, dr, field.Path, v)
	})
}

// fields decodes the fields of one rule (or of the top level, with no
// rule), recording where each was written and what was refused.
type fields struct {
	d    *decoder
	rule string
	w    *where
}

// problem records a problem at n and marks path refused, so that checking
// does not report it again.
func (f fields) problem(n *yaml.Node, path, format string, args ...any) {
	f.d.problems = append(f.d.problems, Problem{Line: n.Line, Column: n.Column, Rule: f.rule, Msg: fmt.Sprintf(format, args...)})
	if path != "" {
		f.w.refuse(path)
	}
}

// mapping calls set for each field of the mapping n whose key is in keys,
// and reports unknown and repeated fields. prefix is put before keys to
// make paths; what names the mapping in a problem when n is not one.
// It reports whether n was a mapping.
func (f fields) mapping(n *yaml.Node, prefix, what string, keys []string, set func(key string, k, v *yaml.Node)) bool {
	if f.alias(n, strings.TrimSuffix(prefix, ".")) {
		return false
	}
	if n.Kind != yaml.MappingNode {
		f.problem(n, strings.TrimSuffix(prefix, "."), "%s must be a mapping of %s", what, strings.Join(keys, ", "))
		return false
	}
	if f.w.nodes == nil {
		f.w.nodes = make([]pathNode, 0, len(n.Content)/2)
	}
	for j := 0; j+1 < len(n.Content); j += 2 {
		k, v := n.Content[j], n.Content[j+1]
		if f.alias(k, "") {
			continue
		}
		if k.Kind != yaml.ScalarNode {
			f.problem(k, "", "field names must be strings")
			continue
		}
		key := k.Value
		if !slices.Contains(keys, key) {
			f.problem(k, "", "unknown field %q%s", prefix+key, suggest(key, keys))
			continue
		}
		if first := firstKey(n.Content[:j], key); first != nil {
			f.problem(k, "", "%s is given twice; the first is at line %d", prefix+key, first.Line)
			continue
		}
		f.w.nodes = append(f.w.nodes, pathNode{prefix + key, v})
		if f.alias(v, prefix+key) {
			continue
		}
		set(key, k, v)
	}
	return true
}

// firstKey returns the first key of the mapping's content that is the
// scalar key, or nil.
func firstKey(content []*yaml.Node, key string) *yaml.Node {
	for j := 0; j+1 < len(content); j += 2 {
		if k := content[j]; k.Kind == yaml.ScalarNode && k.Value == key {
			return k
		}
	}
	return nil
}

// alias refuses an alias node, reporting whether n was one. Following
// aliases would let a small file stand for a huge one (a mapping of
// thousands of bad fields, aliased thousands of times, is millions of
// problems), and a policy has too little repetition to need them.
func (f fields) alias(n *yaml.Node, path string) bool {
	if n.Kind != yaml.AliasNode {
		return false
	}
	f.problem(n, path, "aliases (*%s) are not supported; write the value out", n.Value)
	return true
}

// suggest names the known field a mistyped key probably meant: one within
// two edits of it, ignoring case and the '_' or '-' of other naming styles.
func suggest(key string, keys []string) string {
	fold := func(s string) string { return strings.ToLower(strings.NewReplacer("_", "", "-", "").Replace(s)) }
	best, bestDist := "", 3
	for _, k := range keys {
		if d := editDistance(fold(key), fold(k)); d < bestDist {
			best, bestDist = k, d
		}
	}
	if best == "" {
		return ""
	}
	return " (did you mean " + best + "?)"
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := range len(a) {
		cur := make([]int, len(b)+1)
		cur[0] = i + 1
		for j := range len(b) {
			cost := 1
			if a[i] == b[j] {
				cost = 0
			}
			cur[j+1] = min(prev[j]+cost, prev[j+1]+1, cur[j]+1)
		}
		prev = cur
	}
	return prev[len(b)]
}

// The readers of a field's node: each reports a node that is not of the
// field's type.

func (f fields) str(path string, v *yaml.Node) (string, bool) {
	if v.ShortTag() != strTag {
		f.problem(v, path, "%s must be a string", path)
		return "", false
	}
	return v.Value, true
}

// integer reads a whole number; lo..hi is the field's range, for a
// number too large to read.
func (f fields) integer(path string, v *yaml.Node, lo, hi int) (int, bool) {
	if v.ShortTag() == intTag {
		if x, ok := plainDecimal(v.Value); ok {
			return x, true
		}
		var x int
		if v.Decode(&x) == nil {
			return x, true
		}
	}
	// YAML reads a whole number beyond ±2⁶⁴ as a float, beyond it in hex
	// as a string; none fits any field.
	if _, whole := new(big.Int).SetString(v.Value, 0); !whole || v.Style != 0 {
		f.problem(v, path, "%s must be a whole number", path)
		return 0, false
	}
	f.problem(v, path, "%s %s is outside %d..%d", path, v.Value, lo, hi)
	return 0, false
}

// whole is the reader of a whole number in lo..hi.
func whole(lo, hi int) func(fields, string, *yaml.Node) (int, bool) {
	return func(f fields, path string, v *yaml.Node) (int, bool) { return f.integer(path, v, lo, hi) }
}

// plainDecimal reads a number written as most are, "-"? and digits without
// a leading 0, as the YAML decoder would; the decoder, which allocates for
// each, reads the rest (0x1f, 0o17, 1_000, 017). A policy of 100,000
// rules has 200,000 numbers.
func plainDecimal(s string) (int, bool) {
	digits := strings.TrimPrefix(s, "-")
	if digits == "" || len(digits) > 18 || digits[0] == '0' && len(digits) > 1 {
		return 0, false
	}
	for _, c := range []byte(digits) {
		if c < '0' || c > '9' {
			return 0, false
		}
	}
	x, err := strconv.Atoi(s)
	return x, err == nil
}

func (f fields) number(path string, v *yaml.Node) (float64, bool) {
	var x float64
	if t := v.ShortTag(); t != intTag && t != floatTag || v.Decode(&x) != nil {
		f.problem(v, path, "%s must be a number", path)
		return 0, false
	}
	return x, true
}

func (f fields) boolean(path string, v *yaml.Node) (bool, bool) {
	var b bool
	if v.ShortTag() != boolTag || v.Decode(&b) != nil {
		f.problem(v, path, "%s must be true or false", path)
		return false, false
	}
	return b, true
}

func (f fields) duration(path string, v *yaml.Node) (time.Duration, bool) {
	d, err := time.ParseDuration(v.Value)
	if v.ShortTag() != strTag || err != nil {
		f.problem(v, path, "%s must be a duration such as 30s or 1m", path)
		return 0, false
	}
	return d, true
}
