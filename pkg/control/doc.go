// Package control is egressd's control API as its callers see it: the
// client, the routes' names and wire types, and the errors, over HTTP/JSON
// on a unix socket. The CLI and the SDK use it; the daemon serves it with
// package internal/controlserver, which a caller never links.
//
// # Routes and errors
//
// Routes are named under a version prefix ([Prefix]): the route "status"
// answers at /v1/status. Every error, from the router or from a handler,
// is a JSON body ([ErrorBody])
//
//	{"error": "rule \"payments\" not found", "code": "not_found"}
//
// with the status its [Code] maps to (invalid 400, forbidden 403, not_found
// 404, conflict 409, unavailable 503, internal and anything untyped 500).
// A handler answers with an [*Error] made by [Errorf], or any error
// wrapping one of the sentinels ([ErrInvalid], [ErrNotFound],
// [ErrConflict], [ErrAccessDenied], [ErrUnavailable]).
//
// # Client
//
// A [Client] works at its zero value, talking to $EGRESSD_SOCKET or
// [DefaultSocket]. Typed methods for each route are a few lines on top of
// [Client.Do]; [Client.Stream] reads newline-delimited JSON for long-lived
// responses (egressd events --follow). Errors come back typed: a 403 (or a
// socket the caller may not open) is an [*AccessDeniedError], a missing
// socket or nobody listening on it is a [*NotRunningError] that asks "is
// the daemon running?", and any other failure status is an [*APIError] that
// matches the sentinel of its code with [errors.Is]. The client decodes
// responses leniently (unknown fields are ignored), so a newer daemon can
// add fields without breaking older clients; the server decodes requests
// strictly, so a typo in a field name is an error rather than a silently
// ignored setting.
//
// Who may call which route is decided by the daemon from the peer
// credentials the kernel gives it (see package internal/controlserver):
// anyone who can connect may read, root, the daemon's uid and the
// configured group may also write.
package control
