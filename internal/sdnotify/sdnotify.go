package sdnotify

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"
)

// ErrAddress means $NOTIFY_SOCKET names no socket this package can reach.
var ErrAddress = errors.New("unsupported NOTIFY_SOCKET address")

// Ready tells systemd that start-up, or a reload begun with [Reloading], is
// complete.
func Ready() error { return Notify("READY=1") }

// Stopping tells systemd that the daemon has begun to shut down; systemctl
// shows the unit deactivating until the process exits.
func Stopping() error { return Notify("STOPPING=1") }

// Reloading tells systemd that the daemon is reloading its configuration;
// [Ready] ends the reload. It carries MONOTONIC_USEC, the CLOCK_MONOTONIC
// time of the reload, which Type=notify-reload services must send (systemd
// ≥253 uses it to match the reload to the signal that asked for it) and which
// older systemd ignores.
func Reloading() error {
	if us, ok := monotonicUsec(); ok {
		return Notify("RELOADING=1\nMONOTONIC_USEC=" + strconv.FormatUint(us, 10))
	}
	return Notify("RELOADING=1")
}

// Status sets the one-line status systemctl status shows. Line breaks in s
// become spaces: the protocol is line-based, and a newline would otherwise
// end the status and start another assignment (an error message quoted in
// the status could send READY=1).
func Status(s string) error {
	return Notify("STATUS=" + strings.NewReplacer("\r\n", " ", "\n", " ", "\r", " ").Replace(s))
}

// Watchdog pings systemd's watchdog. A unit with WatchdogSec= is restarted
// when the pings stop for that long; see [WatchdogInterval].
func Watchdog() error { return Notify("WATCHDOG=1") }

// WatchdogInterval returns the watchdog timeout systemd set for this
// process (WatchdogSec=, passed as $WATCHDOG_USEC), and whether the watchdog
// is on. It is off when WATCHDOG_USEC is unset, zero or not a number, or
// when $WATCHDOG_PID names another process (the variables were inherited).
// Ping at least every half of the interval, as sd_watchdog_enabled(3)
// advises, so that one late tick is not a restart.
func WatchdogInterval() (time.Duration, bool) {
	s, ok := os.LookupEnv("WATCHDOG_USEC")
	if !ok {
		return 0, false
	}
	us, err := strconv.ParseUint(s, 10, 64)
	if err != nil || us == 0 || us > uint64(1<<63-1)/uint64(time.Microsecond) {
		return 0, false
	}
	if p, ok := os.LookupEnv("WATCHDOG_PID"); ok {
		pid, err := strconv.Atoi(p)
		if err != nil || pid != os.Getpid() {
			return 0, false
		}
	}
	return time.Duration(us) * time.Microsecond, true
}

// Notify sends state, newline-separated VAR=value assignments as in
// sd_notify(3), to $NOTIFY_SOCKET in one datagram. It returns nil without
// sending anything when $NOTIFY_SOCKET is unset or empty.
func Notify(state string) error {
	name := os.Getenv("NOTIFY_SOCKET")
	if name == "" {
		return nil
	}
	if name[0] != '/' && name[0] != '@' {
		return fmt.Errorf("notify socket %q: %w: want a path or @abstract", name, ErrAddress)
	}
	// A leading '@' makes Go bind to the abstract namespace, exactly as
	// systemd means it.
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("notify socket: %w", err)
	}
	defer conn.Close()
	// One datagram: systemd reads the message whole or not at all.
	if _, err := conn.Write([]byte(state)); err != nil {
		return fmt.Errorf("notify socket: %w", err)
	}
	return nil
}
