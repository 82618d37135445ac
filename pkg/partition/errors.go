package partition

import (
	"errors"

	"github.com/egressd/egressd/pkg/limit"
)

var (
	// ErrInvalidOptions is what every [OptionsError] matches with
	// [errors.Is]; it is [limit.ErrInvalidOptions], so that a caller
	// handles a bad partitioned limiter as it does a bad limiter.
	ErrInvalidOptions = limit.ErrInvalidOptions
	// ErrTooManyPartitions is the cause of the refusal of a key that would
	// be a partition beyond MaxPartitions.
	ErrTooManyPartitions = errors.New("too many partitions")
)

// OptionsError lists every problem [Options.Validate] found.
type OptionsError = limit.OptionsError

// AsOptionsError returns the *OptionsError in err's chain, if any.
func AsOptionsError(err error) (*OptionsError, bool) { return limit.AsOptionsError(err) }
