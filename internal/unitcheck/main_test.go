package unitcheck

import (
	"fmt"
	"os"
	"testing"
)

// stageEnv names the stage a re-run test binary plays in
// TestUnitCapabilities; unset, the binary runs the tests.
const stageEnv = "EGRESSD_UNITCHECK_STAGE"

func TestMain(m *testing.M) {
	stage, ok := stages[os.Getenv(stageEnv)]
	if !ok {
		os.Exit(m.Run())
	}
	code := 0
	if err := stage(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}
