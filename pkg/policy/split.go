package policy

import (
	"bytes"
	"crypto/sha256"
	"hash/fnv"
	"runtime"
	"sync"

	"go.yaml.in/yaml/v3"
)

// A policy of many rules is read in pieces, in parallel. The YAML parser
// spends about 7 µs of CPU per rule, and builds a tree of a dozen nodes
// for each that the garbage collector then marks; 100,000 rules took a
// second. The file is cut between the items of its rules list; each piece
// is parsed as a YAML list of its own, and the top level, without the
// list, on its own.
//
// The cuts are found by lines alone, so each is checked by the parser: a
// cut inside a quoted or flow value leaves the piece before it
// unterminated, which it refuses; an anchor used across pieces is unknown
// where it is used; and every item must start exactly where a cut put it.
// On any refusal, and on any problem with the policy, the whole file is
// parsed again in one piece, which reports the problems with their lines.
// FuzzSplit holds both ways to the same result.
//
// Where the pieces are cut depends on the items' text, not their count: a
// piece ends after an item whose text hashes to a multiple of the piece
// size. An edit then moves no cut but those beside it, and a [Reader]
// reading the file again takes every piece whose text it read last time
// as it was, without parsing it.

// splitMin is about the number of rules below which a policy is read in
// one piece: splitting a short file saves nothing.
const splitMin = 2048

// splitPiece is the number of rules per piece for data, 0 when data is too
// short to be worth splitting. Pieces of 1,024 rules are many per CPU, so
// that the CPUs finish together, and each one's tree is small.
func splitPiece(data []byte) int {
	if len(data) < SizedFrom {
		return 0
	}
	return splitMin / 2
}

// SizedFrom is the length of the shortest text [Size] sizes (80 KiB):
// splitMin rules of at least 40 bytes each, as in
// "- {name: a, destination: b, concurrency: 1}".
const SizedFrom = splitMin * 40

// parseSplit reads data in pieces of about perPiece rules; ok is false when
// it cannot, or when the policy has a problem. With c set, a piece whose
// text c holds is taken from it, and on success c holds this read's pieces.
func parseSplit(data []byte, perPiece int, c *pieceCache) (p *Policy, ok bool) {
	if perPiece <= 0 {
		return nil, false
	}
	s, d, ok := splitTop(data)
	if !ok || len(s.items) <= perPiece {
		return nil, false
	}

	// Each piece decodes into its part of rules: appending the parts
	// would copy every rule again, with the collector's write barrier.
	rules := make([]Rule, len(s.items))
	type piece struct {
		first, n int // its rules: rules[first:first+n]
		sum      [sha256.Size]byte
		ok       bool
		parsed   bool // not found in c
	}
	var pieces []*piece
	starts := s.pieces(data, perPiece)
	for i, first := range starts {
		end := len(s.items)
		if i+1 < len(starts) {
			end = starts[i+1]
		}
		pieces = append(pieces, &piece{first: first, n: end - first})
	}
	work := make(chan *piece)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(pieces)) {
		wg.Go(func() {
			for pc := range work {
				into := rules[pc.first : pc.first+pc.n]
				if c != nil {
					pc.sum = sha256.Sum256(s.text(data, pc.first, pc.n))
					if known, ok := c.rules[pc.sum]; ok && len(known) == pc.n {
						copy(into, known)
						pc.ok = true
						continue
					}
				}
				pc.ok, pc.parsed = s.parse(data, pc.first, into), true
			}
		})
	}
	for _, pc := range pieces {
		work <- pc
	}
	close(work)
	wg.Wait()

	for _, pc := range pieces {
		if !pc.ok {
			return nil, false
		}
	}
	// Without where the rules were written: a problem is reported by the
	// parse in one piece.
	if !clean(rules) || len(checkCapacity(len(rules), d.maxRules, d.maxRulesAt)) > 0 {
		return nil, false
	}
	if c != nil {
		c.rules, c.parsed = make(map[[sha256.Size]byte][]Rule, len(pieces)), 0
		for _, pc := range pieces {
			c.rules[pc.sum] = rules[pc.first : pc.first+pc.n : pc.first+pc.n]
			if pc.parsed {
				c.parsed++
			}
		}
	}
	return &Policy{Rules: rules, MaxRules: d.maxRules, MetricsRules: d.metricsRules}, true
}

// splitTop finds the items of data's rules list, and decodes the rest of
// the top level, without the list, into d.
func splitTop(data []byte) (s split, d decoder, ok bool) {
	if s, ok = splitRules(data); !ok {
		return split{}, decoder{}, false
	}
	rest := append(append([]byte(nil), data[:s.items[0]]...), data[s.end:]...)
	root := d.root(rest)
	if root == nil || !s.keyAt(root) {
		return split{}, decoder{}, false
	}
	if rules, _ := d.top(root); rules != nil || len(d.problems) > 0 {
		return split{}, decoder{}, false
	}
	return s, d, true
}

// Size reads from a large policy's text, without parsing its rules, what
// the size of the tables it needs depends on: how many rules it lists,
// and its maxRules (0: none). ok is false when the text is small, or not
// written so that its rules can be found by their lines: then only [Parse]
// can say. Size says nothing of the policy's validity.
func Size(data []byte) (rules, maxRules int, ok bool) {
	if splitPiece(data) == 0 {
		return 0, 0, false
	}
	s, d, ok := splitTop(data)
	if !ok {
		return 0, 0, false
	}
	return len(s.items), d.maxRules, true
}

// pieceCache holds the rules of the pieces of the last policy read, by the
// SHA-256 of their text: the same text is the same rules, whatever its
// place in the file.
type pieceCache struct {
	rules map[[sha256.Size]byte][]Rule
	// parsed is how many pieces the last read parsed; it found the others
	// here.
	parsed int
}

// pieces cuts the items into pieces of about per items: after an item
// whose text hashes to a multiple of per, once the piece has a quarter of
// per, and in any case at four times per. It returns the index of each
// piece's first item.
func (s split) pieces(data []byte, per int) []int {
	starts := []int{0}
	h := fnv.New64a()
	for i := range len(s.items) - 1 {
		n := i + 1 - starts[len(starts)-1]
		h.Reset()
		h.Write(s.text(data, i, 1))
		if n >= 4*per || n >= per/4 && (h.Sum64()>>32)%uint64(per) == 0 {
			starts = append(starts, i+1)
		}
	}
	return starts
}

// text is the text of n items from the first.
func (s split) text(data []byte, first, n int) []byte {
	end := s.end
	if first+n < len(s.items) {
		end = s.items[first+n]
	}
	return data[s.items[first]:end]
}

// split is where the items of a policy's rules list are, by lines.
type split struct {
	keyLine int   // the line "rules:", from 1
	indent  int   // the items' "-", from 0
	items   []int // offset of each item's first line
	lines   []int // the line of each item, from 1
	end     int   // offset after the list's last line
}

// splitRules finds the items of data's rules list by its lines: the list
// follows a line "rules:" (a comment may end it) in the first column, the
// only one, and each item starts a line with "-" at the indentation of the
// first. A line at a smaller indentation ends the list (at the same, when
// it is the first column). Anything less plain — a tab, a carriage
// return, a directive or document marker, a line at the items'
// indentation that starts no item — is left to the parser whole.
func splitRules(data []byte) (s split, ok bool) {
	if bytes.ContainsAny(data, "\t\r") || bytes.HasPrefix(data, []byte("\xef\xbb\xbf")) {
		return split{}, false
	}
	const (
		before = iota
		first  // after "rules:", before the first item
		inList
		after
	)
	state := before
	for off, n := 0, 1; off < len(data); n++ {
		line := data[off:]
		next := len(data)
		if i := bytes.IndexByte(line, '\n'); i >= 0 {
			line, next = line[:i], off+i+1
		}
		indent := len(line) - len(bytes.TrimLeft(line, " "))
		body := line[indent:]
		blank := len(body) == 0 || body[0] == '#'
		item := len(body) > 0 && body[0] == '-' && (len(body) == 1 || body[1] == ' ')
		if indent == 0 && !blank && !item {
			if bytes.HasPrefix(body, []byte("---")) || bytes.HasPrefix(body, []byte("...")) || body[0] == '%' {
				return split{}, false
			}
			if isRulesKey(body) {
				if state != before {
					return split{}, false
				}
				state, s.keyLine = first, n
				off = next
				continue
			}
		}
		switch {
		case state == first && !blank:
			if !item {
				return split{}, false // an empty list, or not a block list
			}
			state, s.indent = inList, indent
			s.items, s.lines = append(s.items, off), append(s.lines, n)
		case state == inList && !blank:
			switch {
			case indent == s.indent && item:
				s.items, s.lines = append(s.items, off), append(s.lines, n)
			case indent < s.indent || indent == 0:
				state, s.end = after, off
			case indent == s.indent:
				return split{}, false
			}
		}
		off = next
	}
	switch state {
	case inList:
		s.end = len(data)
	case before, first:
		return split{}, false
	}
	return s, true
}

// isRulesKey reports whether a line is "rules:", a comment allowed after.
func isRulesKey(line []byte) bool {
	rest, ok := bytes.CutPrefix(line, []byte("rules:"))
	if !ok {
		return false
	}
	rest = bytes.TrimLeft(rest, " ")
	return len(rest) == 0 || rest[0] == '#' && len(rest) < len(line)-len("rules:")
}

// keyAt reports whether root, the top level without the list, has its key
// rules where the split found it, with no value.
func (s split) keyAt(root *yaml.Node) bool {
	if root.Kind != yaml.MappingNode {
		return false
	}
	for j := 0; j+1 < len(root.Content); j += 2 {
		if k, v := root.Content[j], root.Content[j+1]; k.Value == "rules" {
			return k.Line == s.keyLine && k.Column == 1 && v.Kind == yaml.ScalarNode && v.ShortTag() == nullTag && v.Value == ""
		}
	}
	return false
}

// parse decodes len(rules) items from the first into rules; they must
// parse as a list of as many items, each starting where the split found
// it. The parse tree is garbage once it returns: the heap holds a few
// pieces' trees at a time, not the file's.
func (s split) parse(data []byte, first int, rules []Rule) bool {
	n := len(rules)
	var d decoder
	root := d.root(s.text(data, first, n))
	if root == nil || len(d.problems) > 0 || root.Kind != yaml.SequenceNode || len(root.Content) != n {
		return false
	}
	for i, node := range root.Content {
		if node.Line+s.lines[first]-1 != s.lines[first+i] {
			return false
		}
		rules[i], _ = d.rule(node, first+i)
	}
	return len(d.problems) == 0
}
