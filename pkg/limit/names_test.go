package limit

import "testing"

// The label tables are indexed by their enums; a value added without a name
// would print as empty.
func TestNameTablesCoverEveryValue(t *testing.T) {
	if len(outcomeNames) != int(outcomeLen) || len(queueOrderNames) != int(queueOrderLen) || len(shapeNames) != int(adaptiveShape)+1 {
		t.Fatalf("tables: %d outcomes of %d, %d orders of %d, %d shapes of %d",
			len(outcomeNames), outcomeLen, len(queueOrderNames), queueOrderLen, len(shapeNames), adaptiveShape+1)
	}
	for _, names := range [][]string{outcomeNames[:], queueOrderNames[:], shapeNames[:]} {
		for i, n := range names {
			if n == "" {
				t.Errorf("value %d of %q has no name", i, names)
			}
		}
	}
}
