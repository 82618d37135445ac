package policy

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ErrInvalid is what every [*Error] matches with [errors.Is], for callers
// that only need to know a policy was refused.
var ErrInvalid = errors.New("invalid policy")

// Error lists every problem found in a policy.
type Error struct {
	// File is the policy's path when it came from [Load].
	File     string
	Problems []Problem
}

// Problem is one thing wrong with a policy.
type Problem struct {
	// Line and Column locate the problem in the file, from 1; both are 0
	// for a policy that was built in code rather than parsed. A YAML
	// syntax error has only the line its parser gives, which is often
	// where the enclosing list or mapping began, a line or more early.
	// Every other problem is exact.
	Line, Column int
	// Rule is the rule's name, or "#N" for the Nth rule when it has no
	// name; empty for a problem outside any rule.
	Rule string
	Msg  string
}

// Error writes one problem per line, as compilers do, so that editors and
// terminals can jump to each: "policy.yaml:12:5: rule payments: concurrency
// must be at least 1".
func (e *Error) Error() string {
	if len(e.Problems) == 0 {
		return ErrInvalid.Error()
	}
	var b strings.Builder
	for i, p := range e.Problems {
		if i > 0 {
			b.WriteByte('\n')
		}
		pos := ""
		if p.Line > 0 {
			pos = strconv.Itoa(p.Line)
			if p.Column > 0 {
				pos += ":" + strconv.Itoa(p.Column)
			}
		}
		switch {
		case e.File != "" && pos != "":
			fmt.Fprintf(&b, "%s:%s: ", e.File, pos)
		case e.File != "":
			fmt.Fprintf(&b, "%s: ", e.File)
		case pos != "":
			fmt.Fprintf(&b, "line %s: ", pos)
		}
		if p.Rule != "" {
			fmt.Fprintf(&b, "rule %s: ", p.Rule)
		}
		b.WriteString(p.Msg)
	}
	return b.String()
}

// Is reports whether target is [ErrInvalid].
func (e *Error) Is(target error) bool { return target == ErrInvalid }
