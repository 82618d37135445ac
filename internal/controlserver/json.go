package controlserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// MaxBodyBytes bounds a request body.
const MaxBodyBytes = 1 << 20

// Decode reads the request body into v, a non-nil pointer, strictly: one
// JSON value of at most MaxBodyBytes, no fields v does not have, nothing but
// white space after it. An empty body is an error too. Every problem with
// the body is a *control.Error with CodeInvalid whose message says what and
// where; a v that is not a pointer is a programming error and comes back as
// is.
func Decode(r *http.Request, v any) error {
	return decode(r.Body, v, false)
}

// decode is Decode on a reader; allowEmpty makes an empty body leave v as is.
func decode(body io.Reader, v any, allowEmpty bool) error {
	if body == nil {
		body = http.NoBody
	}
	lr := &io.LimitedReader{R: body, N: MaxBodyBytes + 1}
	tooLarge := func() bool { return lr.N <= 0 }
	dec := json.NewDecoder(lr)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if tooLarge() {
			return errBodyTooLarge
		}
		if err == io.EOF {
			if allowEmpty {
				return nil
			}
			return control.Errorf(control.CodeInvalid, "request body is empty; want a JSON value")
		}
		return decodeError(err)
	}
	_, err := dec.Token()
	switch {
	case tooLarge():
		return errBodyTooLarge
	case err != io.EOF:
		return control.Errorf(control.CodeInvalid, "request body has data after the JSON value (at byte %d)", dec.InputOffset())
	}
	return nil
}

var errBodyTooLarge = &control.Error{Code: control.CodeInvalid, Message: fmt.Sprintf("request body is larger than 1 MiB (%d bytes)", MaxBodyBytes)}

// decodeError rewords encoding/json's errors for whoever sent the body.
func decodeError(err error) error {
	var (
		syntax   *json.SyntaxError
		typ      *json.UnmarshalTypeError
		invalidV *json.InvalidUnmarshalError
	)
	switch {
	case errors.As(err, &invalidV):
		return err // the handler's bug, not the request's
	case errors.As(err, &syntax):
		return &control.Error{Code: control.CodeInvalid, Message: fmt.Sprintf("malformed JSON at byte %d: %s", syntax.Offset, strings.TrimPrefix(syntax.Error(), "json: ")), Err: err}
	case errors.As(err, &typ):
		where := "request body"
		if typ.Field != "" {
			where = "field " + strconv.Quote(typ.Field)
		}
		return &control.Error{Code: control.CodeInvalid, Message: fmt.Sprintf("%s: cannot use JSON %s as %s (at byte %d)", where, typ.Value, typ.Type, typ.Offset), Err: err}
	case errors.Is(err, os.ErrDeadlineExceeded):
		return &control.Error{Code: control.CodeInvalid, Message: "request body not sent in time", Err: err}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &control.Error{Code: control.CodeInvalid, Message: "malformed JSON: the body ends inside a value", Err: err}
	}
	msg := err.Error()
	if f, ok := strings.CutPrefix(msg, "json: unknown field "); ok {
		return &control.Error{Code: control.CodeInvalid, Message: "unknown field " + f, Err: err}
	}
	// A value's own UnmarshalJSON or UnmarshalText refused it.
	return &control.Error{Code: control.CodeInvalid, Message: "invalid request: " + strings.TrimPrefix(msg, "json: "), Err: err}
}

// JSON adapts a typed function to a route handler: the body, if any, is
// decoded into In as Decode does (an empty body leaves In at its zero value,
// so GET routes and argument-less POSTs take struct{}), and the result is
// written as JSON with status 200. The request is passed on for its context
// (PeerFrom, AccessFrom) and query.
func JSON[In, Out any](fn func(r *http.Request, in In) (Out, error)) HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		var in In
		if err := decode(r.Body, &in, true); err != nil {
			return err
		}
		out, err := fn(r, in)
		if err != nil {
			return err
		}
		return WriteJSON(w, http.StatusOK, out)
	}
}

// WriteJSON writes v as a JSON response with the given status. It encodes
// before writing anything, so an unencodable v is an error the handler can
// still answer with.
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode response: %w", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, err = w.Write(append(b, '\n'))
	return err
}

// StreamWriter writes a long-lived response as newline-delimited JSON, one
// value per line, flushed as it goes. control.Client.Stream reads it.
type StreamWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration // for each write
}

// NewStreamWriter starts a 200 response of Content-Type application/x-ndjson
// and flushes the header, so the client knows the stream is open before the
// first value. Once it is called the handler can no longer answer with an
// error status; an error it returns afterwards makes the server cut the
// connection, which the client sees as a broken stream rather than an end.
func NewStreamWriter(w http.ResponseWriter) (*StreamWriter, error) {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	s := &StreamWriter{w: w, rc: http.NewResponseController(w), timeout: writeTimeout}
	if rw, ok := w.(*responseWriter); ok {
		s.timeout = rw.writeTimeout
	}
	if err := s.rc.Flush(); err != nil {
		return nil, fmt.Errorf("stream: %w", err)
	}
	return s, nil
}

// Send writes v as one line and flushes it.
func (s *StreamWriter) Send(v any) error {
	if err := s.Queue(v); err != nil {
		return err
	}
	return s.Flush()
}

// Queue writes v as one line without flushing it: a stream of many
// values goes out as the response's buffer fills, and the handler's
// return (or Flush) sends what is left. 100,000 values sent one by one
// were 100,000 writes to the socket.
func (s *StreamWriter) Queue(v any) error {
	b, err := json.Marshal(v) // compact: no newline inside
	if err != nil {
		return fmt.Errorf("stream: encode: %w", err)
	}
	return s.write(append(b, '\n'))
}

// Flush sends what was queued.
func (s *StreamWriter) Flush() error {
	if err := s.deadline(); err != nil {
		return err
	}
	if err := s.rc.Flush(); err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	return nil
}

// Keepalive writes an empty line, which control.Client.Stream skips (JSON allows
// white space between values), and flushes it. A stream that waits for
// values sends one now and then: only a write finds a peer that left
// without net/http noticing, such as one that sent a byte after its
// request (taken for the next request, that byte stops net/http watching
// the connection).
func (s *StreamWriter) Keepalive() error {
	if err := s.write([]byte{'\n'}); err != nil {
		return err
	}
	return s.Flush()
}

// writeTimeout bounds one write of a response, to a stream or not: a
// peer that stops reading would otherwise hold its handler, and a stop,
// for ever.
const writeTimeout = 10 * time.Second

// write writes b, to go out when the buffer fills or is flushed.
func (s *StreamWriter) write(b []byte) error {
	if err := s.deadline(); err != nil {
		return err
	}
	if _, err := s.w.Write(b); err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	return nil
}

// deadline gives the next write of the connection the stream's timeout.
func (s *StreamWriter) deadline() error {
	err := s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		return fmt.Errorf("stream: %w", err)
	}
	return nil
}
