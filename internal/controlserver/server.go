package controlserver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// HandlerFunc answers one route. It writes a response and returns nil, or
// returns an error and writes nothing: the server turns the error into a
// JSON error response (see control.Error and the sentinels for the status).
type HandlerFunc func(w http.ResponseWriter, r *http.Request) error

// Route is one entry of the route table.
type Route struct {
	// Method is the one HTTP method the route answers; others get 405.
	Method string
	// Write marks a route that changes state; only peers with write access
	// may call it.
	Write bool
	// Stream marks a long-lived response (NDJSON from a StreamWriter): its
	// request context is cancelled when the server shuts down, so that
	// Shutdown does not wait for it forever.
	Stream bool
	// Handler answers the route.
	Handler HandlerFunc
}

// Config is what a Server serves and where.
type Config struct {
	// Socket is the socket's path; empty means control.DefaultSocket.
	Socket string
	// Mode is the socket's permission bits; 0 means DefaultMode (0660).
	Mode fs.FileMode
	// Group, a name or numeric gid, owns the socket, and its members have
	// write access. Empty: no group; only root and the daemon's uid write.
	Group string
	// Routes maps route names (served at control.Prefix+name) to routes.
	Routes map[string]Route
	// Logger receives handler failures and panics (Error) and one line
	// per request (Debug). Nil means slog.Default().
	Logger *slog.Logger
}

// Server serves the control API. Make it with New.
type Server struct {
	socket string
	mode   fs.FileMode
	group  string
	routes map[string]Route
	policy accessPolicy
	log    *slog.Logger
	hs     *http.Server

	streams     context.Context // cancelled when the server stops
	stopStreams context.CancelFunc

	// bodyTimeout bounds the reading of a request's body.
	bodyTimeout time.Duration
	// writeTimeout bounds one write of a response: a StreamWriter's, or
	// a chunk of at most writeChunk bytes of any other.
	writeTimeout time.Duration
}

const (
	// bodyTimeout is how long a peer has to send a request's body.
	bodyTimeout = 10 * time.Second
	// streamEndGrace is how long an ending stream's writes, the end of
	// the response included, have before they fail: a peer that stops
	// reading would otherwise hold up a Shutdown.
	streamEndGrace = time.Second
	// writeChunk is how much of a response other than a stream is written
	// under one write deadline (writeTimeout): a peer that reads, however
	// slowly, is not cut off from a large answer, while one that stops
	// reading is.
	writeChunk = 64 << 10
)

var methods = []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// New checks cfg, reporting every problem at once, and resolves the
// group. It does not create the socket; Listen does.
func New(cfg Config) (*Server, error) {
	var problems []string
	if cfg.Mode&^fs.ModePerm != 0 {
		problems = append(problems, fmt.Sprintf("mode %v has more than permission bits", cfg.Mode))
	}
	policy := accessPolicy{self: uint32(os.Geteuid())}
	if cfg.Group != "" {
		g, err := lookupGroup(cfg.Group)
		if err != nil {
			problems = append(problems, err.Error())
		}
		policy.group, policy.hasGroup = g, err == nil
	}
	if len(cfg.Routes) == 0 {
		problems = append(problems, "no routes")
	}
	names := make([]string, 0, len(cfg.Routes))
	for name := range cfg.Routes {
		names = append(names, name)
	}
	slices.Sort(names)
	routes := make(map[string]Route, len(cfg.Routes))
	for _, name := range names {
		rt := cfg.Routes[name]
		if msg := checkRouteName(name); msg != "" {
			problems = append(problems, fmt.Sprintf("route %q: %s", name, msg))
		}
		if !slices.Contains(methods, rt.Method) {
			problems = append(problems, fmt.Sprintf("route %q: method %q is not one of %s", name, rt.Method, strings.Join(methods, ", ")))
		}
		if rt.Handler == nil {
			problems = append(problems, fmt.Sprintf("route %q: no handler", name))
		}
		routes[name] = rt
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("control server: %s", strings.Join(problems, "; "))
	}

	s := &Server{
		socket: cfg.Socket,
		mode:   cfg.Mode,
		group:  cfg.Group,
		routes: routes,
		policy: policy,
		log:    cfg.Logger,

		bodyTimeout:  bodyTimeout,
		writeTimeout: writeTimeout,
	}
	if s.socket == "" {
		s.socket = control.DefaultSocket
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	s.streams, s.stopStreams = context.WithCancel(context.Background())
	s.hs = &http.Server{
		Handler:           s,
		ConnContext:       connContext,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		// Set as each request is read, so that what net/http writes
		// itself has a deadline too. The handlers' writes, a stream's
		// among them, push it on as they go (responseWriter.Write,
		// StreamWriter), so it bounds a write, not a response.
		WriteTimeout: writeTimeout,
	}
	s.hs.RegisterOnShutdown(s.stopStreams)
	return s, nil
}

// checkRouteName returns what is wrong with a route name, or "".
func checkRouteName(name string) string {
	switch {
	case name == "":
		return "empty name"
	case strings.HasPrefix(name, "/"), strings.HasSuffix(name, "/"), strings.Contains(name, "//"):
		return "name must not start or end with / or contain //"
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("-_./", c)) {
			return fmt.Sprintf("name has %q; use letters, digits and - _ . /", c)
		}
	}
	return ""
}

// connContext records the connection's peer credentials for every request
// on it.
func connContext(ctx context.Context, c net.Conn) context.Context {
	p, err := peerOf(c)
	if err != nil {
		return withPeerError(ctx, err)
	}
	return context.WithValue(ctx, peerKey{}, &peerInfo{peer: p})
}

// Listen creates the socket the server was configured with; see the
// package-level Listen.
func (s *Server) Listen() (net.Listener, error) {
	return Listen(s.socket, &ListenOptions{Mode: s.mode, Group: s.group})
}

// Serve answers connections on ln until Shutdown or Close, and then returns
// nil. ln should come from Listen: on any other kind of listener no peer
// has credentials and every request is refused.
func (s *Server) Serve(ln net.Listener) error {
	err := s.hs.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown stops accepting connections, ends streams (their contexts are
// cancelled), waits for the other requests in flight to finish or for ctx,
// and closes the listener, which removes the socket.
func (s *Server) Shutdown(ctx context.Context) error {
	s.stopStreams()
	return s.hs.Shutdown(ctx)
}

// Close stops the server at once, cutting requests in flight.
func (s *Server) Close() error {
	s.stopStreams()
	return s.hs.Close()
}

// browserHeaders are set by browsers (and only sensibly by them); any of
// them on a request means a web page may be driving it.
var browserHeaders = []string{"Origin", "Referer", "Sec-Fetch-Site"}

// ServeHTTP routes a request. The peer comes from the request's context
// (set from the connection by Serve, or by WithPeer in tests).
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rw := &responseWriter{ResponseWriter: w, writeTimeout: s.writeTimeout}
	name, err := s.serve(rw, r)
	if err != nil {
		s.fail(rw, r, name, err)
	}
	if !rw.stream {
		// What net/http writes once the handler is done (the header
		// alone, or the end of the body) has a write's time too, however
		// long the handler took.
		rw.extendWrite()
	}
	if s.log.Enabled(r.Context(), slog.LevelDebug) {
		p, _ := PeerFrom(r.Context())
		s.log.Debug("control request", "method", r.Method, "path", r.URL.Path, "status", rw.status, "peer", p.String())
	}
}

// serve does the routing and checks, then calls the handler. It returns
// the route's name, for logs, and the error to answer with.
func (s *Server) serve(w *responseWriter, r *http.Request) (string, error) {
	for _, h := range browserHeaders {
		if r.Header.Get(h) != "" {
			return "", control.Errorf(control.CodeForbidden, "request has a %s header: the control API does not answer browsers", h)
		}
	}
	pi := peerInfoFrom(r.Context())
	switch {
	case pi == nil:
		return "", control.Errorf(control.CodeForbidden, "peer credentials unavailable: not a control socket connection")
	case pi.err != nil:
		return "", control.Errorf(control.CodeForbidden, "peer credentials unavailable: %v", pi.err)
	}
	name, ok := strings.CutPrefix(r.URL.Path, control.Prefix)
	if !ok {
		return "", control.Errorf(control.CodeNotFound, "no route at %q: the control API is under %s", r.URL.Path, control.Prefix)
	}
	route, ok := s.routes[name]
	if !ok {
		return name, control.Errorf(control.CodeNotFound, "unknown route %q", r.URL.Path)
	}
	if r.Method != route.Method {
		w.Header().Set("Allow", route.Method)
		return name, &methodNotAllowed{control.Errorf(control.CodeInvalid, "method %s not allowed on %s (use %s)", r.Method, r.URL.Path, route.Method)}
	}
	access := permit(pi.peer, s.policy)
	if route.Write && access < AccessWrite {
		return name, control.Errorf(control.CodeForbidden, "%s changes egressd's state and needs %s; you are uid %d gid %d",
			r.URL.Path, s.writers(), pi.peer.UID, pi.peer.GID)
	}
	ctx := context.WithValue(r.Context(), accessKey{}, access)
	if route.Stream {
		w.stream = true
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		stop := context.AfterFunc(s.streams, cancel)
		defer stop()
		end := context.AfterFunc(ctx, w.endWrites)
		defer func() {
			if end() {
				// What net/http writes after the handler, the end of the
				// stream, has a write's time too.
				w.SetWriteDeadline(time.Now().Add(s.writeTimeout))
			}
		}()
	}
	if r.ContentLength != 0 {
		// Set only with a body to read: net/http reads a body-less
		// connection in the background from the start, and there this
		// deadline would end the request. Once the body is read, net/http
		// lifts it to read in the background.
		http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.bodyTimeout))
	}
	return name, s.call(route.Handler, w, r.WithContext(ctx), name)
}

// writers says who has write access, for a 403's message.
func (s *Server) writers() string {
	who := "root"
	if s.policy.self != 0 {
		who += fmt.Sprintf(" or uid %d", s.policy.self)
	}
	if s.policy.hasGroup {
		who += fmt.Sprintf(" or membership of group %s", s.group)
	}
	return who
}

// call runs a handler, turning a panic into an error. http.ErrAbortHandler
// passes through: it is how a handler asks net/http to cut the connection.
func (s *Server) call(h HandlerFunc, w http.ResponseWriter, r *http.Request, name string) (err error) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		if v == http.ErrAbortHandler {
			panic(v)
		}
		s.log.Error("control handler panic", "route", name, "panic", v, "stack", string(debug.Stack()))
		err = &control.Error{Code: control.CodeInternal, Message: fmt.Sprintf("internal error in %s: panic: %v", r.URL.Path, v)}
	}()
	return h(w, r)
}

// fail answers with err. If the handler already started its response (a
// stream), a status can no longer be sent: the connection is cut instead,
// so the client sees a broken stream and not a clean end.
func (s *Server) fail(w *responseWriter, r *http.Request, name string, err error) {
	status, body := classify(err)
	if errors.Is(err, context.Canceled) || r.Context().Err() != nil {
		// The client left (^C on events --follow), or a stream was ended
		// by Shutdown: nobody to tell, nothing wrong.
		s.log.Debug("control request ended", "route", name, "err", err)
		if w.wrote {
			return
		}
	} else if status >= 500 {
		s.log.Error("control request failed", "route", name, "method", r.Method, "status", status, "err", err)
	}
	if w.wrote {
		if status < 500 {
			s.log.Error("control stream failed", "route", name, "err", err)
		}
		panic(http.ErrAbortHandler)
	}
	if err := WriteJSON(w, status, body); err != nil {
		s.log.Debug("control: write error response", "err", err)
	}
}

// responseWriter notes whether the response has started (and its status,
// for the log). Unwrap and FlushError keep http.ResponseController working.
// A stream's writes end (endWrites) when its context does; any other
// response is written writeChunk bytes at a time, each with writeTimeout
// to go.
type responseWriter struct {
	http.ResponseWriter
	wrote  bool
	status int
	// writeTimeout is the server's, for a StreamWriter on w and for the
	// chunks of any other response.
	writeTimeout time.Duration
	// stream is set for a Stream route: its StreamWriter sets the
	// deadline of each write.
	stream bool

	mu    sync.Mutex
	ended bool
}

var errStreamEnded = errors.New("stream ended")

// SetWriteDeadline sets the connection's write deadline, unless the
// stream has ended: its deadline stays.
func (w *responseWriter) SetWriteDeadline(t time.Time) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		return errStreamEnded
	}
	return http.NewResponseController(w.ResponseWriter).SetWriteDeadline(t)
}

// endWrites gives the writes of a stream that ends streamEndGrace, so
// that one blocked on a peer that does not read fails.
func (w *responseWriter) endWrites() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ended = true
	http.NewResponseController(w.ResponseWriter).SetWriteDeadline(time.Now().Add(streamEndGrace))
}

func (w *responseWriter) WriteHeader(code int) {
	if !w.wrote && code >= 200 {
		w.wrote, w.status = true, code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *responseWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.wrote, w.status = true, http.StatusOK
	}
	if w.stream {
		return w.ResponseWriter.Write(b)
	}
	var n int
	for {
		w.extendWrite()
		m, err := w.ResponseWriter.Write(b[:min(len(b), writeChunk)])
		n, b = n+m, b[m:]
		if err != nil || len(b) == 0 {
			return n, err
		}
	}
}

// extendWrite gives the next write of a response other than a stream
// writeTimeout: a peer that stops reading fails it, and the handler (or
// net/http, after it) returns instead of waiting for ever.
func (w *responseWriter) extendWrite() {
	// Not every ResponseWriter has deadlines (httptest's has not); those
	// that have not do not wait on a peer either.
	http.NewResponseController(w.ResponseWriter).SetWriteDeadline(time.Now().Add(w.writeTimeout))
}

func (w *responseWriter) FlushError() error {
	if !w.wrote {
		w.wrote, w.status = true, http.StatusOK
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *responseWriter) Flush() { w.FlushError() }

func (w *responseWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
