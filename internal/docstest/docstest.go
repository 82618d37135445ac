// Package docstest holds the docs to what the code does: a test names what
// it found in the code, and the docs must mention each.
package docstest

import (
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Mentions fails t for each name that doc (a path) does not mention as
// code: `name`.
func Mentions(t testing.TB, doc string, names ...string) {
	t.Helper()
	b, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if !strings.Contains(string(b), "`"+n+"`") {
			t.Errorf("%s does not document `%s`", doc, n)
		}
	}
}

// Families gathers c on a fresh registry and returns its metric family
// names.
func Families(t testing.TB, c prometheus.Collector) []string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range fams {
		names = append(names, f.GetName())
	}
	return names
}
