package shared

import (
	"errors"
	"strings"
)

var (
	// ErrInvalidOptions is what every [OptionsError] matches with
	// [errors.Is].
	ErrInvalidOptions = errors.New("invalid shared limiter options")
	// ErrStore is what every [StoreError] matches: no decision could be had
	// from Redis.
	ErrStore = errors.New("shared limiter store")
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

// StoreError is a decision Redis did not give: Acquire returns it under
// FailureMode Throw, and a Deny refusal wraps it. Err is the client's error.
type StoreError struct {
	Limiter string
	Op      string // "acquire", "renew" or "release"
	Err     error
}

func (e *StoreError) Error() string {
	return "shared limiter " + e.Limiter + " " + e.Op + ": " + e.Err.Error()
}

// Is reports whether target is [ErrStore].
func (e *StoreError) Is(target error) bool { return target == ErrStore }

// Unwrap returns the client's error.
func (e *StoreError) Unwrap() error { return e.Err }

// AsStoreError returns the *StoreError in err's chain, if any.
func AsStoreError(err error) (*StoreError, bool) {
	return errors.AsType[*StoreError](err)
}
