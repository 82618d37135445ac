// Package controlserver serves egressd's control API (package control):
// HTTP/JSON over a unix socket, with who may call which route decided by
// the kernel's account of the peer. The daemon is its user; the CLI and
// the SDK use package control's client and never link this package.
//
// A [Server] serves a table of routes ([Route]) keyed by name under
// control.Prefix (the route "status" answers at /v1/status), each with one
// method and a Write flag. Handlers return errors, not status codes: a *control.Error
// made by control.Errorf, or an error wrapping one of package control's
// sentinels, which the server writes as a control.ErrorBody with the
// status of its code; a handler that panics is answered with a 500.
// [Decode] reads a request body strictly (one JSON value of at most
// [MaxBodyBytes], no unknown fields), [JSON] adapts a typed function to a
// handler, and [StreamWriter] writes newline-delimited JSON.
//
// Access comes from the peer's credentials as the kernel gave them when it
// connected: write (every route) for uid 0, the daemon's uid and members
// of the configured group; read (routes whose Write is false) for anyone
// else who could connect; nothing for a connection whose credentials cannot
// be read. Requests carrying Origin, Referer or Sec-Fetch-Site are refused.
// Handlers read the caller with [PeerFrom] and its access with
// [AccessFrom]. docs/design.md ("Control API") has the reasons and caveats.
package controlserver
