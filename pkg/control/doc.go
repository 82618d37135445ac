// Package control is egressd's control API as its callers see it: the
// client, the routes' names and wire types, and the errors, over HTTP/JSON
// on a unix socket. The CLI and the SDK use it; the daemon serves it with
// package internal/controlserver, which a caller never links.
//
// A [Client] works at its zero value, talking to $EGRESSD_SOCKET or
// [DefaultSocket]. Typed methods for each route are a few lines on top of
// [Client.Do]; [Client.Stream] reads newline-delimited JSON for long-lived
// responses (egressd events --follow). Errors come back typed: a 403 (or a
// socket the caller may not open) is an [*AccessDeniedError], a missing
// socket or nobody listening on it a [*NotRunningError] that asks "is the
// daemon running?", and any other failure status an [*APIError] matching
// the sentinel of its [Code] ([ErrInvalid], [ErrNotFound], ...) with
// [errors.Is].
//
// Routes are named under [Prefix]: the route "status" answers at
// /v1/status. Every error is an [ErrorBody], {"error": "...", "code":
// "not_found"}. Responses are decoded leniently, so a newer daemon may add
// fields; the daemon decodes requests strictly. Anyone who can connect may
// read; root, the daemon's uid and the socket's group may also write
// (docs/operations.md, "The control socket").
package control
