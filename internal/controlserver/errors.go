package controlserver

import (
	"context"
	"errors"
	"net/http"

	"github.com/egressd/egressd/pkg/control"
)

// methodNotAllowed is the router's answer to a route called with the wrong
// method: an invalid request, answered 405 rather than 400.
type methodNotAllowed struct{ err *control.Error }

func (e *methodNotAllowed) Error() string { return e.err.Error() }

func (e *methodNotAllowed) Unwrap() error { return e.err }

// classify turns whatever a handler returned into a status and a body. The
// message is the whole error text, so wrapping context survives.
func classify(err error) (int, control.ErrorBody) {
	code := control.CodeInternal
	var e *control.Error
	switch {
	case errors.As(err, &e):
		code = e.Code
	case errors.Is(err, control.ErrInvalid):
		code = control.CodeInvalid
	case errors.Is(err, control.ErrNotFound):
		code = control.CodeNotFound
	case errors.Is(err, control.ErrConflict):
		code = control.CodeConflict
	case errors.Is(err, control.ErrAccessDenied):
		code = control.CodeForbidden
	case errors.Is(err, control.ErrUnavailable), errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		code = control.CodeUnavailable
	}
	if code == "" {
		code = control.CodeInternal
	}
	status := code.Status()
	if _, ok := errors.AsType[*methodNotAllowed](err); ok {
		status = http.StatusMethodNotAllowed
	}
	msg := err.Error()
	if msg == "" {
		msg = http.StatusText(status)
	}
	return status, control.ErrorBody{Error: msg, Code: code}
}
