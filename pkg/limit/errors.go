package limit

import (
	"errors"
	"strings"
)

var (
	// ErrInvalidOptions is what every [OptionsError] matches with
	// [errors.Is], for callers that only need to know the configuration was
	// refused.
	ErrInvalidOptions = errors.New("invalid limiter options")
	// ErrQueueFull is the cause a refusal wraps when the caller could not
	// even wait: the queue was full, or (NewestFirst) a newer caller took its
	// place in it.
	ErrQueueFull = errors.New("queue full")
)

// OptionsError lists every problem [Options.Validate] found.
type OptionsError struct {
	Problems []string
}

func (e *OptionsError) Error() string {
	return ErrInvalidOptions.Error() + ": " + strings.Join(e.Problems, "; ")
}

// Is reports whether target is [ErrInvalidOptions].
func (e *OptionsError) Is(target error) bool { return target == ErrInvalidOptions }

// AsOptionsError returns the *OptionsError in err's chain, if any.
func AsOptionsError(err error) (*OptionsError, bool) {
	return errors.AsType[*OptionsError](err)
}
