// Package sdnotify tells systemd how the daemon is doing, through the
// sd_notify(3) protocol: one datagram of newline-separated VAR=value
// assignments sent to the unix socket named by $NOTIFY_SOCKET.
//
// egressd's unit is Type=notify, so systemd counts the daemon started only
// once it sends [Ready] (after the datapath is loaded or adopted and the
// control socket listens), shows [Status] in systemctl status, restarts it if
// [Watchdog] pings stop for WatchdogSec, and reports a reload in progress
// between [Reloading] and the next [Ready]:
//
//	if err := sdnotify.Ready(); err != nil {
//		logger.Warn("sd_notify", "err", err)
//	}
//	if every, ok := sdnotify.WatchdogInterval(); ok {
//		ticker := time.NewTicker(every / 2) // systemd's advice: ping at half the interval
//		...
//	}
//
// Every function is a no-op returning nil when $NOTIFY_SOCKET is unset or
// empty, as it is when the daemon runs outside systemd (a terminal, a test,
// Type=simple), so callers need no "am I under systemd?" check. An error
// means systemd asked for notifications and did not get this one; the daemon
// should log it and carry on, since enforcement does not depend on it.
//
// Socket addresses are a filesystem path ("/run/systemd/notify") or an
// abstract socket ("@name", as systemd --user and systemd-nspawn use).
// vsock addresses (systemd ≥254, for VMs) are refused with an error.
//
// The package depends on the standard library and golang.org/x/sys only,
// so that it costs the daemon nothing beyond what it already imports.
package sdnotify
