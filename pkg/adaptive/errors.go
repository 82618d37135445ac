package adaptive

import (
	"errors"
	"strings"
)

// ErrInvalidOptions is what every [OptionsError] matches with [errors.Is], for
// callers that only need to know the configuration was refused.
var ErrInvalidOptions = errors.New("invalid adaptive options")

// OptionsError lists every problem [Options.Validate] found.
type OptionsError struct {
	Problems []string
}

func (e *OptionsError) Error() string {
	return ErrInvalidOptions.Error() + ": " + strings.Join(e.Problems, "; ")
}

// Is reports whether target is [ErrInvalidOptions].
func (e *OptionsError) Is(target error) bool {
	return target == ErrInvalidOptions
}
