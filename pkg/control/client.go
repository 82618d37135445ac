package control

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Client talks to the daemon's control socket. Its zero value uses
// $EGRESSD_SOCKET, or DefaultSocket when that is unset, and no timeout
// beyond the caller's context. Set the fields
// before the first call; a Client is safe for concurrent use after that and
// must not be copied (it keeps its connections).
//
// Typed calls for a route are a few lines each on top of Do, Get or Post:
//
//	func (c *Client) Status(ctx context.Context) (*Status, error) {
//		var st Status
//		return &st, c.Get(ctx, "status", &st)
//	}
type Client struct {
	// Socket is the socket's path; empty means $EGRESSD_SOCKET, else
	// DefaultSocket (the CLI's --socket reads the same variable).
	Socket string
	// Timeout bounds each call, including reading the response; for
	// Stream it bounds only the wait for the response to start. Zero means
	// no bound beyond the context.
	Timeout time.Duration
	// Dial, if set, replaces dialling Socket (for tests). Its errors are
	// classified like the default dialler's.
	Dial func(ctx context.Context) (net.Conn, error)

	once sync.Once
	hc   *http.Client
}

// host is the Host header of every request; the socket is the address.
const host = "egressd"

// Prefix is the path under which routes are served: route "status" is
// /v1/status.
const Prefix = "/v1/"

// DefaultSocket is where the daemon listens unless told otherwise.
const DefaultSocket = "/run/egressd/egressd.sock"

// SocketEnv names the environment variable that moves the socket for
// every zero-value Client in a process: the CLI, and services using the SDK.
const SocketEnv = "EGRESSD_SOCKET"

func (c *Client) socket() string {
	switch {
	case c.Socket != "":
		return c.Socket
	case os.Getenv(SocketEnv) != "":
		return os.Getenv(SocketEnv)
	}
	return DefaultSocket
}

func (c *Client) init() {
	c.once.Do(func() {
		tr := &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return c.dial(ctx)
			},
			MaxIdleConns:           4,
			IdleConnTimeout:        30 * time.Second,
			DisableCompression:     true,
			MaxResponseHeaderBytes: 64 << 10,
		}
		c.hc = &http.Client{Transport: tr}
	})
}

// dial connects and classifies failures: no socket or nobody listening is
// a *NotRunningError, no permission on the socket an *AccessDeniedError.
func (c *Client) dial(ctx context.Context) (net.Conn, error) {
	var (
		conn net.Conn
		err  error
	)
	if c.Dial != nil {
		conn, err = c.Dial(ctx)
	} else {
		var d net.Dialer
		conn, err = d.DialContext(ctx, "unix", c.socket())
	}
	switch {
	case err == nil:
		return conn, nil
	case errors.Is(err, syscall.ENOENT), errors.Is(err, syscall.ECONNREFUSED):
		return nil, &NotRunningError{Socket: c.socket(), Err: err}
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return nil, &AccessDeniedError{
			Message: "permission denied on egressd's socket " + c.socket() + "; run as root or as a member of the socket's group",
			Err:     err,
		}
	}
	return nil, err
}

// CloseIdleConnections closes connections kept for reuse.
func (c *Client) CloseIdleConnections() {
	c.init()
	c.hc.CloseIdleConnections()
}

// Get calls a route with GET and decodes the answer into out.
func (c *Client) Get(ctx context.Context, route string, out any) error {
	return c.Do(ctx, http.MethodGet, route, nil, out)
}

// Post calls a route with POST, sending in as JSON, and decodes the answer
// into out.
func (c *Client) Post(ctx context.Context, route string, in, out any) error {
	return c.Do(ctx, http.MethodPost, route, in, out)
}

// Do calls a route: route is a name ("status") optionally followed by a
// query ("limit?name=payments"; build it with url.Values.Encode). A non-nil
// in is sent as JSON; a non-nil out receives the JSON answer (unknown fields
// are ignored; an empty answer leaves it as is).
//
// Errors: *NotRunningError when the daemon cannot be reached,
// *AccessDeniedError for a 403 or a socket we may not open, *APIError for
// any other failure status (errors.Is matches ErrNotFound, ErrInvalid,
// ErrConflict, ErrUnavailable by its code), and the context's error,
// wrapped, when it ends first.
func (c *Client) Do(ctx context.Context, method, route string, in, out any) error {
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	resp, err := c.send(ctx, method, route, in, "application/json")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		io.Copy(io.Discard, resp.Body)
		return nil
	}
	err = json.NewDecoder(resp.Body).Decode(out)
	switch {
	case err == io.EOF:
		return nil // no body
	case err != nil:
		return fmt.Errorf("%s %s: decode answer: %w", method, route, err)
	}
	return nil
}

// Stream calls a route with GET and hands each newline-delimited JSON value
// of the answer to fn, until the daemon ends the stream (nil), fn returns
// an error (that error), the context ends (its error) or the stream breaks.
// The value passed to fn is not reused.
func (c *Client) Stream(ctx context.Context, route string, fn func(json.RawMessage) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var timer *time.Timer
	if c.Timeout > 0 {
		timer = time.AfterFunc(c.Timeout, cancel)
	}
	resp, err := c.send(ctx, http.MethodGet, route, nil, "application/x-ndjson")
	if timer != nil && !timer.Stop() {
		if err == nil {
			resp.Body.Close()
		}
		return fmt.Errorf("GET %s: no answer within %v: %w", route, c.Timeout, context.DeadlineExceeded)
	}
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	for {
		var v json.RawMessage
		err := dec.Decode(&v)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			if errors.Is(err, io.ErrUnexpectedEOF) {
				return fmt.Errorf("GET %s: stream broken: the daemon ended it without finishing: %w", route, err)
			}
			return fmt.Errorf("GET %s: stream: %w", route, err)
		}
		if err := fn(v); err != nil {
			return err
		}
	}
}

// send makes the request and turns a failure status into an error. On
// success the caller owns the body.
func (c *Client) send(ctx context.Context, method, route string, in any, accept string) (*http.Response, error) {
	c.init()
	u, err := url.Parse("http://" + host + Prefix + strings.TrimPrefix(route, "/"))
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, route, err)
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, fmt.Errorf("%s %s: encode request: %w", method, route, err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, route, err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", "egressd-control")
	resp, err := c.hc.Do(req)
	if err != nil {
		var (
			nr *NotRunningError
			ad *AccessDeniedError
		)
		switch {
		case errors.As(err, &nr):
			return nil, nr
		case errors.As(err, &ad):
			return nil, ad
		}
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%s %s: %w", method, route, err)
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return resp, nil
	}
	defer resp.Body.Close()
	return nil, responseError(resp)
}

// responseError reads a failure response.
func responseError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var we ErrorBody
	msg := ""
	if err := json.Unmarshal(b, &we); err == nil && we.Error != "" {
		msg = we.Error
	} else {
		we.Code = ""
		msg = strings.TrimSpace(string(b))
	}
	if resp.StatusCode == http.StatusForbidden {
		if msg == "" {
			msg = "egressd refused the request (403)"
		}
		return &AccessDeniedError{Message: msg}
	}
	return &APIError{Status: resp.StatusCode, Code: we.Code, Message: msg}
}
