package control

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"syscall"
)

// Code classifies an API error. It travels in the "code" field of every
// error body and decides the HTTP status.
type Code string

// The codes of the API. A handler error without one is internal.
const (
	CodeInvalid     Code = "invalid"     // 400: the request is malformed or a value is bad
	CodeForbidden   Code = "forbidden"   // 403: the caller may not do this
	CodeNotFound    Code = "not_found"   // 404: no such route, rule, ...
	CodeConflict    Code = "conflict"    // 409: it exists already, or changed under you
	CodeUnavailable Code = "unavailable" // 503: the daemon cannot do it now
	CodeInternal    Code = "internal"    // 500: a bug or an unexpected failure
)

// Status is the HTTP status the code maps to; unknown codes map to 500.
func (c Code) Status() int {
	switch c {
	case CodeInvalid:
		return http.StatusBadRequest
	case CodeForbidden:
		return http.StatusForbidden
	case CodeNotFound:
		return http.StatusNotFound
	case CodeConflict:
		return http.StatusConflict
	case CodeUnavailable:
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// sentinel is the error a code matches with errors.Is, on both sides.
func (c Code) sentinel() error {
	switch c {
	case CodeInvalid:
		return ErrInvalid
	case CodeForbidden:
		return ErrAccessDenied
	case CodeNotFound:
		return ErrNotFound
	case CodeConflict:
		return ErrConflict
	case CodeUnavailable:
		return ErrUnavailable
	}
	return nil
}

var (
	// ErrInvalid is matched by errors with code "invalid".
	ErrInvalid = errors.New("invalid request")
	// ErrNotFound is matched by errors with code "not_found".
	ErrNotFound = errors.New("not found")
	// ErrConflict is matched by errors with code "conflict".
	ErrConflict = errors.New("conflict")
	// ErrUnavailable is matched by errors with code "unavailable".
	ErrUnavailable = errors.New("unavailable")
	// ErrAccessDenied is matched by every *AccessDeniedError and by errors
	// with code "forbidden".
	ErrAccessDenied = errors.New("access denied")
	// ErrNotRunning is matched by every *NotRunningError.
	ErrNotRunning = errors.New("egressd is not running")
)

// Error is what a handler returns to answer with a given code. Its message
// goes to the client verbatim.
type Error struct {
	Code    Code
	Message string
	// Err is the cause, if any; it is not sent.
	Err error
}

// Errorf makes an *Error. The format supports %w, which sets Err.
func Errorf(code Code, format string, args ...any) *Error {
	err := fmt.Errorf(format, args...)
	e := &Error{Code: code, Message: err.Error()}
	switch err.(type) {
	case interface{ Unwrap() error }, interface{ Unwrap() []error }:
		e.Err = err // keeps every %w operand reachable
	}
	return e
}

func (e *Error) Error() string { return e.Message }

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// Is matches the sentinel of the error's code.
func (e *Error) Is(target error) bool {
	s := e.Code.sentinel()
	return s != nil && target == s
}

// ErrorBody is the JSON body of every error response.
type ErrorBody struct {
	Error string `json:"error"`
	Code  Code   `json:"code"`
}

// APIError is a failure status from the daemon other than 403.
type APIError struct {
	Status  int    // HTTP status
	Code    Code   // from the body; empty if the body was not an API error
	Message string // from the body, or the body itself
}

func (e *APIError) Error() string {
	if e.Message != "" {
		return e.Message
	}
	return "egressd: HTTP " + strconv.Itoa(e.Status) + " " + http.StatusText(e.Status)
}

// Is matches the sentinel of the error's code (ErrNotFound, ErrInvalid,
// ErrConflict, ErrUnavailable).
func (e *APIError) Is(target error) bool {
	s := e.Code.sentinel()
	return s != nil && target == s
}

// AsAPIError returns the *APIError in err's chain, if any.
func AsAPIError(err error) (*APIError, bool) {
	var e *APIError
	ok := errors.As(err, &e)
	return e, ok
}

// AccessDeniedError is a refusal: the daemon answered 403, or the socket
// could not be opened for lack of permission.
type AccessDeniedError struct {
	Message string
	Err     error // the dial error, when the socket refused us
}

func (e *AccessDeniedError) Error() string {
	if e.Message == "" {
		return ErrAccessDenied.Error()
	}
	return e.Message
}

// Is matches ErrAccessDenied.
func (e *AccessDeniedError) Is(target error) bool { return target == ErrAccessDenied }

// Unwrap returns the dial error, if any.
func (e *AccessDeniedError) Unwrap() error { return e.Err }

// IsAccessDenied reports whether err is, or wraps, a refusal.
func IsAccessDenied(err error) bool { return errors.Is(err, ErrAccessDenied) }

// NotRunningError says the socket does not exist or nobody listens on it.
type NotRunningError struct {
	Socket string
	Err    error // the dial error
}

func (e *NotRunningError) Error() string {
	cause := "cannot connect"
	var errno syscall.Errno
	if errors.As(e.Err, &errno) {
		cause = errno.Error()
	}
	return "cannot reach egressd: " + cause + "; is the daemon running? (socket " + e.Socket + ")"
}

// Is matches ErrNotRunning.
func (e *NotRunningError) Is(target error) bool { return target == ErrNotRunning }

// Unwrap returns the dial error.
func (e *NotRunningError) Unwrap() error { return e.Err }

// IsNotRunning reports whether err says the daemon could not be reached.
func IsNotRunning(err error) bool { return errors.Is(err, ErrNotRunning) }
