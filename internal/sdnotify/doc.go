// Package sdnotify tells systemd how the daemon is doing, through the
// sd_notify(3) protocol: one datagram of newline-separated VAR=value
// assignments sent to the unix socket named by $NOTIFY_SOCKET.
//
// egressd's unit is Type=notify (see docs/operations.md): [Ready] once the
// datapath is loaded or adopted and the control socket listens, [Reloading]
// until the next Ready, [Status] for systemctl status, and [Watchdog]
// pings at half of [WatchdogInterval]:
//
//	if err := sdnotify.Ready(); err != nil {
//		logger.Warn("sd_notify", "err", err)
//	}
//
// Every function is a no-op returning nil when $NOTIFY_SOCKET is unset or
// empty (a terminal, a test, Type=simple), so callers need no "am I under
// systemd?" check. An error means systemd asked for this notification and
// did not get it: log it and carry on, since enforcement does not depend on
// it. Socket addresses are a path or an abstract socket ("@name"); vsock
// addresses are refused with an error.
package sdnotify
