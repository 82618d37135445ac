package shared

import (
	"errors"

	"github.com/egressd/egressd/pkg/limit"
)

// Options problems are reported as in package limit: the same sentinel and
// typed error, so a caller handles a bad local or shared limiter alike.
var (
	// ErrInvalidOptions is what every [OptionsError] matches with
	// [errors.Is]; it is [limit.ErrInvalidOptions].
	ErrInvalidOptions = limit.ErrInvalidOptions
	// ErrStore is what every [StoreError] matches: no decision could be had
	// from Redis.
	ErrStore = errors.New("shared limiter store")
)

// OptionsError lists every problem [Options.Validate] found.
type OptionsError = limit.OptionsError

// AsOptionsError returns the *OptionsError in err's chain, if any.
func AsOptionsError(err error) (*OptionsError, bool) { return limit.AsOptionsError(err) }

// StoreError is a decision Redis did not give: Acquire returns it under
// FailureMode Throw, and a Deny refusal wraps it; Slots and Grants return it
// for every failure. Err is the client's error.
type StoreError struct {
	Limiter string // the limiter's name, or Slots' and Grants' key
	Op      string // "acquire", "renew", "release", "resize", "claim" or "return"
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
