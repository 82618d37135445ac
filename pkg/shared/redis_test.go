package shared

import (
	"testing"

	"github.com/egressd/egressd/internal/redistest"
)

// startRedis starts a real redis-server for the test (see redistest).
func startRedis(t testing.TB) *redistest.Server { return redistest.Start(t) }
