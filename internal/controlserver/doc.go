// Package controlserver serves egressd's control API (package control):
// HTTP/JSON over a unix socket, with who may call which route decided by
// the kernel's account of the peer. The daemon is its user; the CLI and
// the SDK use package control's client and never link this package.
//
// # Routes
//
// A [Server] serves a route table keyed by name under control.Prefix: the
// route "status" answers at /v1/status. Each [Route] names its one method
// and whether it changes state (Write). An unknown route is a 404, a wrong
// method a 405 (with an Allow header), and every error, from the router or
// from a handler, is a control.ErrorBody with the status its control.Code
// maps to. Handlers return errors, not status codes: a *control.Error made
// by control.Errorf, or any error wrapping one of package control's
// sentinels. A panicking handler is recovered and answered with a 500; the
// daemon keeps running.
//
// [Decode] reads a request body strictly: one JSON value of at most
// [MaxBodyBytes], no unknown fields, nothing after it. Every problem is a
// 400 whose message says what was wrong and where. [JSON] adapts a typed
// function to a handler. [StreamWriter] writes newline-delimited JSON for
// long-lived responses (egressd events --follow) and long ones (the list
// of 100,000 rules, sent as it is read); control.Client.Stream reads them.
//
// # Who may do what
//
// The socket is the only way in: there is no TCP listener, and requests that
// carry an Origin, Referer or Sec-Fetch-Site header are refused with a 403
// before routing, so that a web page can never drive the API even through a
// local proxy. The socket is created with mode 0660 (owner root, group the
// configured group, if any), so the kernel keeps everyone else from
// connecting at all.
//
// Whoever gets a connection is identified by the kernel, not by anything they
// send: the peer's pid, uid and gid (SO_PEERCRED) and supplementary groups
// (SO_PEERGROUPS, or the Groups line of /proc/PID/status on kernels before
// 4.13), as they were when the peer called connect. From those:
//
//   - write (every route): uid 0, the daemon's own uid, or a member of the
//     configured group, as primary or supplementary group;
//   - read (routes whose Write is false): anyone else who could connect.
//
// Read-only access exists for the cases where the socket mode is widened on
// purpose (e.g. 0666 so that every service's SDK can ask "did you refuse
// me?"): widening the mode then never grants the right to change limits.
// A connection whose credentials cannot be read gets nothing: every request
// on it is a 403. Handlers read the caller's identity with [PeerFrom] (the
// SDK's refusal query uses the pid) and its access with [AccessFrom].
//
// Credentials are those of the process that connected; a process that
// changes its uid afterwards keeps the access it connected with, as with any
// SO_PEERCRED check. UIDs and pids are as seen from the daemon's namespaces;
// a peer in a pid namespace the daemon cannot see has pid 0.
//
// The tests here run package control's client against this server: they
// are the control API's tests, both halves.
package controlserver
