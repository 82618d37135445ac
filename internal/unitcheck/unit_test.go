package unitcheck

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// unitPath is the unit as the repository keeps it; tests run in this
// package's directory.
var unitPath = filepath.Join("..", "..", "systemd", "egressd.service")

// directive is one Key=Value line of a unit file.
type directive struct {
	Section, Key, Value string
	Line                int
	// Comment is the block of comment lines directly above, without '#'.
	Comment []string
}

// parseUnit reads a unit file's directives, joining continued lines.
func parseUnit(t *testing.T, path string) []directive {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		out       []directive
		section   string
		comment   []string
		continued *directive
	)
	s := bufio.NewScanner(f)
	for n := 1; s.Scan(); n++ {
		line := strings.TrimSpace(s.Text())
		switch {
		case continued != nil:
			continued.Value += " " + strings.TrimSuffix(line, `\`)
			if !strings.HasSuffix(line, `\`) {
				out = append(out, *continued)
				continued = nil
			}
		case line == "":
			comment = nil
		case line[0] == '#' || line[0] == ';':
			comment = append(comment, strings.TrimSpace(line[1:]))
		case line[0] == '[':
			section = strings.Trim(line, "[]")
			comment = nil
		default:
			key, value, ok := strings.Cut(line, "=")
			if !ok {
				t.Fatalf("%s:%d: not Key=Value: %q", path, n, line)
			}
			d := directive{Section: section, Key: strings.TrimSpace(key), Value: strings.TrimSpace(value), Line: n, Comment: comment}
			comment = nil
			if strings.HasSuffix(d.Value, `\`) {
				d.Value = strings.TrimSuffix(d.Value, `\`)
				continued = &d
				continue
			}
			out = append(out, d)
		}
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// lookup returns the last directive for section and key; for settings that
// take one value, the last assignment wins.
func lookup(ds []directive, section, key string) (directive, bool) {
	for _, d := range slices.Backward(ds) {
		if d.Section == section && d.Key == key {
			return d, true
		}
	}
	return directive{}, false
}

// words returns every word assigned to a list setting, in order.
func words(ds []directive, section, key string) []string {
	var out []string
	for _, d := range ds {
		if d.Section == section && d.Key == key {
			out = append(out, strings.Fields(d.Value)...)
		}
	}
	return out
}

// TestSettings holds the unit to the decisions its comments explain.
func TestSettings(t *testing.T) {
	ds := parseUnit(t, unitPath)
	exact := []struct{ key, want string }{
		{"Type", "notify"},
		{"ExecStart", "/usr/local/bin/egressd run --policy /etc/egressd/policy.yaml"},
		{"ExecReload", "/bin/kill -HUP $MAINPID"},
		{"Restart", "always"},
		{"WatchdogSec", "30s"},
		{"RuntimeDirectory", "egressd"},
		{"StateDirectory", "egressd"},
		{"ConfigurationDirectory", "egressd"},
		{"ProtectSystem", "strict"},
		{"ProtectHome", "yes"},
		{"PrivateTmp", "yes"},
		{"NoNewPrivileges", "yes"},
		{"MemoryDenyWriteExecute", "yes"},
		{"RestrictNamespaces", "yes"},
		{"SystemCallArchitectures", "native"},
		{"UMask", "0077"},
		// yes would mount /sys/fs/bpf read-only, past ReadWritePaths.
		{"ProtectKernelTunables", "no"},
		// yes is read-only cgroupfs, which attaching allows; private and
		// strict (systemd >= 257) would hide the host's cgroup root.
		{"ProtectControlGroups", "yes"},
		// TestUnitCapabilities arranges its sandbox as these say.
		{"ReadOnlyPaths", "/sys"},
		{"ProcSubset", "pid"},
		{"ProtectProc", "invisible"},
	}
	for _, tt := range exact {
		t.Run(tt.key, func(t *testing.T) {
			d, ok := lookup(ds, "Service", tt.key)
			if !ok || d.Value != tt.want {
				t.Errorf("[Service] %s=%q, want %q", tt.key, d.Value, tt.want)
			}
		})
	}
	contains := []struct{ key, want, why string }{
		{"ReadWritePaths", "/sys/fs/bpf", "the pins that keep enforcement across restarts"},
		{"SystemCallFilter", "bpf", "@system-service lacks bpf(2)"},
		{"RestrictAddressFamilies", "AF_UNIX", "the control socket and sd_notify"},
		{"RestrictAddressFamilies", "AF_INET", "the metrics listener"},
	}
	for _, tt := range contains {
		t.Run(tt.key+"/"+tt.want, func(t *testing.T) {
			if got := words(ds, "Service", tt.key); !slices.Contains(got, tt.want) {
				t.Errorf("[Service] %s=%q lacks %s: %s", tt.key, strings.Join(got, " "), tt.want, tt.why)
			}
		})
	}
	// Namespaces that would cut the daemon off from what it manages.
	absent := []struct{ key, why string }{
		{"PrivateNetwork", "the recount iterator sees only the daemon's network namespace, and metrics must be reachable"},
		{"PrivateUsers", "capabilities in a user namespace do not reach the host's BPF"},
		{"PrivateBPF", "a private bpffs would lose the pins when the daemon exits"},
		{"User", "bpffs and the state directory are root's, and CAP_DAC_OVERRIDE is not granted"},
		{"DynamicUser", "bpffs and the state directory are root's, and CAP_DAC_OVERRIDE is not granted"},
	}
	for _, tt := range absent {
		t.Run("no "+tt.key, func(t *testing.T) {
			if d, ok := lookup(ds, "Service", tt.key); ok {
				t.Errorf("line %d: %s=%s: %s", d.Line, d.Key, d.Value, tt.why)
			}
		})
	}
	if d, ok := lookup(ds, "Install", "WantedBy"); !ok || d.Value != "multi-user.target" {
		t.Errorf("[Install] WantedBy=%q, want multi-user.target", d.Value)
	}
}

// systemd has no trailing comments: "Key=value # why" sets the value to
// "value # why", which some settings then reject and others take as is.
func TestNoTrailingComments(t *testing.T) {
	for _, d := range parseUnit(t, unitPath) {
		if strings.Contains(d.Value, " #") || strings.Contains(d.Value, "\t#") {
			t.Errorf("line %d: %s=%s: a '#' after a value is part of the value; put the comment on its own line above", d.Line, d.Key, d.Value)
		}
	}
}

// linuxCapabilities are the capability names of capabilities(7).
var linuxCapabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
	"CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
	"CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
	"CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
	"CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
	"CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
	"CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
}

// unitCapabilities returns the unit's capability bounding set.
func unitCapabilities(t *testing.T) []string {
	t.Helper()
	caps := words(parseUnit(t, unitPath), "Service", "CapabilityBoundingSet")
	if len(caps) == 0 {
		t.Fatal("no CapabilityBoundingSet: the daemon would keep every capability root has")
	}
	if strings.HasPrefix(caps[0], "~") {
		t.Fatalf("CapabilityBoundingSet=%s is a deny list: it grants every capability it does not name", strings.Join(caps, " "))
	}
	return caps
}

// TestCapabilities checks that the unit grants known capabilities, the same
// ones in both sets, and each with its reason in the comment above
// CapabilityBoundingSet= (a "CAP_X:" entry before "Not granted"). That is
// the only way to grant CAP_SYS_ADMIN: with a comment saying why.
func TestCapabilities(t *testing.T) {
	ds := parseUnit(t, unitPath)
	bounding := unitCapabilities(t)
	ambient := words(ds, "Service", "AmbientCapabilities")
	d, _ := lookup(ds, "Service", "CapabilityBoundingSet")
	granted, _, _ := strings.Cut(strings.Join(d.Comment, "\n"), "Not granted")
	for _, c := range bounding {
		t.Run(c, func(t *testing.T) {
			if !slices.Contains(linuxCapabilities, c) {
				t.Errorf("%s is not a capability (systemd-analyze verify lets unknown names pass)", c)
			}
			if !slices.Contains(ambient, c) {
				t.Errorf("%s is in CapabilityBoundingSet but not AmbientCapabilities", c)
			}
			if !strings.Contains(granted, c+":") {
				t.Errorf("%s is granted without a reason: explain it as \"%s: why\" in the comment above CapabilityBoundingSet=, before \"Not granted\"", c, c)
			}
		})
	}
	for _, c := range ambient {
		if !slices.Contains(bounding, c) {
			t.Errorf("AmbientCapabilities has %s, which CapabilityBoundingSet does not: systemd refuses to start the unit", c)
		}
	}
}

// TestVerify runs systemd-analyze verify on the unit. verify checks that
// ExecStart's binary exists, and /usr/local/bin/egressd is not installed
// where tests run, so the unit is verified as a copy in a temporary
// directory whose ExecStart points at an executable placeholder there;
// nothing is written outside temporary directories.
func TestVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("skipping: systemd-analyze is not installed (Debian: apt-get install systemd; CI installs it so this runs)")
	}
	ds := parseUnit(t, unitPath)
	for _, d := range ds {
		if !strings.HasPrefix(d.Key, "Exec") || d.Key == "ExecStart" {
			continue
		}
		bin := strings.TrimLeft(strings.Fields(d.Value)[0], "-@:+!|")
		if _, err := os.Stat(bin); err != nil {
			t.Skipf("skipping: %s=%s needs %s, which this machine lacks (Debian: apt-get install procps)", d.Key, d.Value, bin)
		}
	}
	data, err := os.ReadFile(unitPath)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	placeholder := filepath.Join(dir, "egressd")
	if err := os.WriteFile(placeholder, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	const execStart = "\nExecStart=/usr/local/bin/egressd "
	if !strings.Contains(string(data), execStart) {
		t.Fatalf("%s has no %q line to point at the placeholder", unitPath, strings.TrimSpace(execStart))
	}
	unit := strings.Replace(string(data), execStart, "\nExecStart="+placeholder+" ", 1)

	t.Run("unit", func(t *testing.T) {
		ours, other, err := verify(t, analyze, dir, unit)
		if len(ours) > 0 {
			t.Fatalf("systemd-analyze verify found problems in the unit:\n%s", strings.Join(ours, "\n"))
		}
		if err != nil {
			t.Skipf("skipping: systemd-analyze verify failed for reasons outside the unit (%v):\n%s", err, strings.Join(other, "\n"))
		}
		for _, l := range other {
			t.Logf("systemd-analyze (not about the unit): %s", l)
		}
	})
	// verify must be able to fail here, or passing means nothing.
	t.Run("catches a bad key", func(t *testing.T) {
		broken := strings.Replace(unit, "\nProtectHome=", "\nProtectHom=", 1)
		ours, _, err := verify(t, analyze, t.TempDir(), broken)
		if err == nil || !slices.ContainsFunc(ours, func(l string) bool { return strings.Contains(l, "ProtectHom") }) {
			t.Errorf("systemd-analyze verify passed a unit with an unknown key (%v):\n%s", err, strings.Join(ours, "\n"))
		}
	})
}

// verify writes unit as dir/egressd.service, runs systemd-analyze verify on
// it, and splits its output into the lines about the unit and the rest:
// the machine's own state (no systemd as PID 1, a container) may add lines
// that say nothing about the unit.
func verify(t *testing.T, analyze, dir, unit string) (ours, other []string, err error) {
	t.Helper()
	path := filepath.Join(dir, "egressd.service")
	if err := os.WriteFile(path, []byte(unit), 0o644); err != nil {
		t.Fatal(err)
	}
	// --man=no: Documentation= is a URL, and man pages may be absent.
	// --recursive-errors=no (systemd >= 250): judge this unit, not the
	// units it is ordered after.
	args := []string{"verify", "--man=no"}
	if analyzeVersion(t, analyze) >= 250 {
		args = append(args, "--recursive-errors=no")
	}
	cmd := exec.Command(analyze, append(args, path)...)
	cmd.Dir = dir
	// Warnings and errors are what verify reports problems at; a
	// SYSTEMD_LOG_LEVEL=debug inherited from the caller would bury them.
	cmd.Env = append(os.Environ(), "SYSTEMD_LOG_LEVEL=warning", "SYSTEMD_LOG_COLOR=0", "SYSTEMD_PAGER=cat")
	out, err := cmd.CombinedOutput()
	for l := range strings.Lines(string(out)) {
		l = strings.TrimSpace(l)
		switch {
		case l == "":
		case strings.Contains(l, path) || strings.Contains(l, "egressd.service"):
			ours = append(ours, l)
		default:
			other = append(other, l)
		}
	}
	return ours, other, err
}

// analyzeVersion reads "systemd 252 (252.38-1~deb12u1)".
func analyzeVersion(t *testing.T, analyze string) int {
	t.Helper()
	out, err := exec.Command(analyze, "--version").Output()
	if err != nil {
		t.Fatalf("systemd-analyze --version: %v", err)
	}
	var v int
	if _, err := fmt.Sscanf(string(out), "systemd %d", &v); err != nil {
		t.Fatalf("systemd-analyze --version: %q: %v", out, err)
	}
	return v
}
