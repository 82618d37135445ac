package unitcheck

import (
	"bufio"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/loader"
)

var stages = map[string]func(args []string) error{
	"sandbox":  runSandbox,
	"datapath": runDatapath,
}

// TestUnitCapabilities runs the datapath as the unit runs the daemon: in a
// mount namespace arranged as the unit arranges it, with only the unit's
// capabilities. It loads and attaches the programs, adds a rule that
// attaches the per-packet ones, runs the recount iterator, closes, and
// adopts the pins again as a restarted daemon does; the pins must then be
// visible from the host's namespace. Then it does the same without each
// capability in turn, which must fail: the unit grants nothing unused.
//
// What is not reproduced is the unit's seccomp filter; a trace of the same
// steps uses no system call outside @system-service but bpf(2).
func TestUnitCapabilities(t *testing.T) {
	privtest.RequireRoot(t)
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("skipping: setpriv is not installed (Debian: util-linux)")
	}
	type capCase struct {
		name    string
		caps    []string
		wantErr bool
	}
	caps := unitCapabilities(t)
	tests := []capCase{{name: "unit's capabilities", caps: caps}}
	for _, c := range caps {
		without := slices.DeleteFunc(slices.Clone(caps), func(x string) bool { return x == c })
		tests = append(tests, capCase{name: "without " + c, caps: without, wantErr: true})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cgroup := privtest.Cgroup(t, "unitcaps")
			pins := privtest.PinDir(t)
			out, err := runStages(t, setpriv, tt.caps, cgroup, pins)
			if (err != nil) != tt.wantErr {
				t.Fatalf("datapath under %v: err = %v, want error %v; output:\n%s", tt.caps, err, tt.wantErr, out)
			}
			t.Logf("output:\n%s", out)
			if links := pinned(t, pins); (len(links) > 0) == tt.wantErr {
				t.Errorf("links pinned in %s, as the host sees them: %v", pins, links)
			}
		})
	}
}

// runStages re-runs the test binary as the sandbox stage, in a new mount
// namespace; the sandbox stage execs setpriv, which execs the datapath stage.
func runStages(t *testing.T, setpriv string, caps []string, cgroup, pins string) (string, error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), exe, setpriv, setprivCaps(caps), cgroup, pins)
	cmd.Env = append(os.Environ(), stageEnv+"=sandbox")
	// Go makes the new namespace's mounts private before exec, so nothing
	// the sandbox remounts reaches the host.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// setprivCaps turns [CAP_BPF CAP_NET_ADMIN] into setpriv's -all,+bpf,+net_admin.
func setprivCaps(caps []string) string {
	s := "-all"
	for _, c := range caps {
		s += ",+" + strings.ToLower(strings.TrimPrefix(c, "CAP_"))
	}
	return s
}

// pinned lists the links pinned under pins (the loader keeps them in
// PinDir/links).
func pinned(t *testing.T, pins string) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(pins, "links"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// runSandbox, as root in a fresh mount namespace, arranges it as the unit
// does and execs the datapath stage under setpriv with only caps:
//   - every mount read-only (ProtectSystem=strict, ReadOnlyPaths=/sys,
//     ProtectControlGroups=yes) but /sys/fs/bpf (ReadWritePaths=) and the
//     API file systems /proc and /dev, which the unit arranges otherwise;
//   - a procfs of the pid subset that hides other users' processes
//     (ProcSubset=pid, ProtectProc=invisible);
//   - no capabilities but caps, no new privileges (CapabilityBoundingSet=,
//     AmbientCapabilities=, NoNewPrivileges=).
//
// Arguments: setpriv, caps as setpriv takes them, cgroup, pin directory.
func runSandbox(args []string) error {
	if len(args) != 4 {
		return fmt.Errorf("sandbox: want setpriv caps cgroup pins, got %q", args)
	}
	setpriv, caps, rest := args[0], args[1], args[2:]
	mounts, err := mountPoints()
	if err != nil {
		return err
	}
	for _, m := range mounts {
		if under(m, "/sys/fs/bpf") || under(m, "/proc") || under(m, "/dev") {
			continue
		}
		if err := remountReadOnly(m); err != nil && under(m, "/sys") {
			return err
		}
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "subset=pid,hidepid=invisible"); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	argv := append([]string{setpriv, "--bounding-set=" + caps, "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--", exe}, rest...)
	env := append(slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, stageEnv+"=") }), stageEnv+"=datapath")
	return syscall.Exec(setpriv, argv, env)
}

// under reports whether path is dir or below it.
func under(path, dir string) bool { return path == dir || strings.HasPrefix(path, dir+"/") }

// mountPoints lists this namespace's mount points, parents first.
func mountPoints() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		// id parent major:minor root mount-point options ...
		if fields := strings.Fields(s.Text()); len(fields) > 4 {
			out = append(out, unescapeMount(fields[4]))
		}
	}
	return out, s.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

// remountReadOnly makes one mount read-only, keeping its other flags (a
// bind remount that left them out would clear nosuid and the like).
func remountReadOnly(path string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", path, err)
	}
	keep := uintptr(st.Flags) & (unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	if err := unix.Mount("", path, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|keep, ""); err != nil {
		return fmt.Errorf("remount %s read-only: %w", path, err)
	}
	return nil
}

// runDatapath does what the daemon does with the datapath, as the unit
// lets it. Arguments: cgroup, pin directory.
func runDatapath(args []string) error {
	if len(args) != 2 {
		return fmt.Errorf("datapath: want cgroup pins, got %q", args)
	}
	// Make sure the sandbox holds, or passing would prove nothing.
	if err := unix.Access(args[0], unix.W_OK); !errors.Is(err, unix.EROFS) {
		return fmt.Errorf("sandbox: cgroup %s should be on a read-only mount, access(W_OK) = %v", args[0], err)
	}
	if _, err := os.Stat("/proc/sys"); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("sandbox: /proc/sys should be hidden by the pid subset, stat = %v", err)
	}
	cfg := &loader.Config{Cgroup: args[0], PinDir: args[1], MaxRules: 16}
	d, err := loader.Open(cfg)
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	// Tracking requests attaches the cgroup_skb programs, whose attach
	// (not load) is what needs CAP_NET_ADMIN.
	rule := loader.Rule{
		Name:     "unitcheck",
		Dests:    []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		Port:     9,
		Shape:    loader.ShapeConcurrency,
		Limit:    4,
		Requests: true,
	}
	if err := d.Put(rule); err != nil {
		d.Close()
		return fmt.Errorf("put: %w", err)
	}
	if _, err := d.Recount(); err != nil {
		d.Close()
		return fmt.Errorf("recount: %w", err)
	}
	if err := d.Close(); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	d, err = loader.Open(cfg)
	if err != nil {
		return fmt.Errorf("adopt: %w", err)
	}
	defer d.Close()
	if !d.Adopted() || len(d.Rules()) != 1 {
		return fmt.Errorf("adopt: adopted %v with %d rules, want the pinned datapath and its rule", d.Adopted(), len(d.Rules()))
	}
	fmt.Println("loaded, attached, recounted and adopted")
	return nil
}
