package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/docstest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// doctorChildEnv makes a re-run test binary the egressd command line,
// for the runs without privileges.
const doctorChildEnv = "EGRESSD_CLI_TEST_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(doctorChildEnv) != "" {
		os.Exit(Main(os.Args))
	}
	os.Exit(m.Run())
}

var (
	repoUnit     = filepath.Join("..", "..", "systemd", "egressd.service")
	repoPolicy   = filepath.Join("..", "..", "examples", "policy.yaml")
	absentSocket = filepath.Join(os.TempDir(), "egressd-doctor-test-no-daemon.sock")
)

// doctor runs `egressd doctor --json` in this process.
func doctor(t *testing.T, args ...string) (doctorReport, error) {
	t.Helper()
	app := App()
	var out bytes.Buffer
	app.Writer = &out
	app.ExitErrHandler = func(*cli.Context, error) {}
	err := app.Run(append([]string{"egressd", "--socket", absentSocket, "doctor", "--json"}, args...))
	var r doctorReport
	if jerr := json.Unmarshal(out.Bytes(), &r); jerr != nil {
		t.Fatalf("doctor --json printed no report (%v):\n%s", jerr, out.String())
	}
	return r, err
}

func (r doctorReport) find(t *testing.T, name string) check {
	t.Helper()
	i := slices.IndexFunc(r.Checks, func(c check) bool { return c.Name == name })
	if i < 0 {
		t.Fatalf("no %q check in %+v", name, r.Checks)
	}
	return r.Checks[i]
}

// wantStatus checks a check's status and that its detail says something.
func wantStatus(t *testing.T, r doctorReport, name, status string, detail ...string) {
	t.Helper()
	c := r.find(t, name)
	if c.Status != status {
		t.Errorf("%s: %s (%s), want %s", name, c.Status, c.Detail, status)
	}
	for _, d := range detail {
		if !strings.Contains(c.Detail, d) {
			t.Errorf("%s: detail %q does not say %q", name, c.Detail, d)
		}
	}
	if (c.Status == statusFail || c.Status == statusWarn) && c.Fix == "" {
		t.Errorf("%s: %s without a fix", name, c.Status)
	}
}

// TestDoctorOnThisHost: on a host that runs the datapath (this one, as
// root), every kernel check passes and doctor exits 0.
func TestDoctorOnThisHost(t *testing.T) {
	privtest.RequireRoot(t)
	pins := privtest.PinDir(t)
	r, err := doctor(t, "--bpffs", pins, "--unit", repoUnit, "--policy", repoPolicy)
	if err != nil || !r.CanRun {
		t.Errorf("doctor: err %v, canRun %v; want exit 0 on a host that runs the datapath", err, r.CanRun)
	}
	for _, name := range []string{"kernel", "privileges", "btf", "bpf map types", "bpf prog types", "bpf helpers", "bpf attach", "bpf isa", "datapath load", "cgroup v2", "bpffs"} {
		wantStatus(t, r, name, statusPass)
	}
	root, err := cgroups.Mount()
	if err != nil {
		t.Fatal(err)
	}
	wantStatus(t, r, "cgroup v2", statusPass, "mounted at "+root)
	wantStatus(t, r, "unit caps", statusPass, "CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON")
	wantStatus(t, r, "policy", statusPass, "rule(s)")
	wantStatus(t, r, "datapath", statusInfo, "nothing pinned at "+pins)
	wantStatus(t, r, "control socket", statusInfo, "no daemon answers")
	if len(r.Features) == 0 || slices.ContainsFunc(r.Features, func(f feature) bool { return !f.OK }) {
		t.Errorf("features: %+v", r.Features)
	}
	if !slices.ContainsFunc(r.Features, func(f feature) bool { return f.Name == "bpf_set_retval in CGroupSockAddr" && f.OK }) {
		t.Error("--json does not list bpf_set_retval in CGroupSockAddr as probed")
	}
}

// TestDoctorPinned: a pinned datapath is reported with its holder while
// a process has it open, as enforcing alone once none does, and as a
// failure when it is attached elsewhere than the daemon would attach.
func TestDoctorPinned(t *testing.T) {
	privtest.RequireRoot(t)
	cg := privtest.Cgroup(t, "doctor")
	pins := privtest.PinDir(t)
	d, err := loader.Open(&loader.Config{Cgroup: cg, PinDir: pins, MaxRules: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := loader.Uninstall(pins); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	args := []string{"--bpffs", pins, "--cgroup", cg, "--unit", repoUnit, "--policy", repoPolicy}

	r, _ := doctor(t, args...)
	wantStatus(t, r, "datapath", statusPass, "pinned at "+pins, "connect4", "16 rule slots", fmt.Sprintf("held by pid %d", os.Getpid()))

	r, _ = doctor(t, "--bpffs", pins, "--unit", repoUnit, "--policy", repoPolicy)
	wantStatus(t, r, "datapath", statusFail, "attached elsewhere", cg)
	if r.CanRun {
		t.Error("canRun with a datapath the daemon could not adopt")
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	r, err = doctor(t, args...)
	wantStatus(t, r, "datapath", statusWarn, "no process holds it")
	if err != nil || !r.CanRun {
		t.Errorf("a pinned datapath without a daemon: err %v, canRun %v; the daemon can run and adopt it", err, r.CanRun)
	}
}

// TestDoctorFindsProblems: each thing that keeps the daemon from running
// fails its check, with a fix, and doctor exits 1.
func TestDoctorFindsProblems(t *testing.T) {
	privtest.RequireRoot(t)
	dir := t.TempDir()
	unit, err := os.ReadFile(repoUnit)
	if err != nil {
		t.Fatal(err)
	}
	noPerfmon := filepath.Join(dir, "egressd.service")
	if err := os.WriteFile(noPerfmon, bytes.ReplaceAll(unit, []byte(" CAP_PERFMON"), nil), 0o644); err != nil {
		t.Fatal(err)
	}
	badPolicy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(badPolicy, []byte("rules:\n  - name: x\n    destination: 10.0.0.0/33\n    concurrency: 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, check, detail string
		args                []string
	}{
		{"unit without CAP_PERFMON", "unit caps", "lacks CAP_PERFMON", []string{"--unit", noPerfmon, "--policy", repoPolicy}},
		{"bad policy", "policy", "2 problem(s)", []string{"--unit", repoUnit, "--policy", badPolicy}},
		{"missing policy", "policy", "no such file", []string{"--unit", repoUnit, "--policy", filepath.Join(dir, "none.yaml")}},
		{"pins off bpffs", "bpffs", "is not a bpffs", []string{"--unit", repoUnit, "--policy", repoPolicy, "--bpffs", filepath.Join(dir, "egressd")}},
		{"no such cgroup", "cgroup v2", "no such file", []string{"--unit", repoUnit, "--policy", repoPolicy, "--cgroup", "/egressd-doctor-test-absent"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, err := doctor(t, tt.args...)
			wantStatus(t, r, tt.check, statusFail, tt.detail)
			var exit cli.ExitCoder
			if r.CanRun || !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Errorf("canRun %v, err %v; want exit 1", r.CanRun, err)
			}
		})
	}
}

// TestDoctorWithoutPrivileges runs doctor as nobody, and as root of a
// user namespace owned by nobody (what `unshare -U -r` gives): it must
// say what it could not check and why, exit 1, and not crash.
func TestDoctorWithoutPrivileges(t *testing.T) {
	privtest.RequireRoot(t)
	const nobody = 65534
	exe, dir := publicCopy(t)
	// The checkout may be where nobody cannot read (/root): the unit and
	// the policy go beside the binary.
	policyCopy, unitCopy := filepath.Join(dir, "policy.yaml"), filepath.Join(dir, "egressd.service")
	for src, dst := range map[string]string{repoPolicy: policyCopy, repoUnit: unitCopy} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tt := range []struct {
		name       string
		attr       *syscall.SysProcAttr
		privileges string
	}{
		{"nobody", &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}, "uid 65534 lacks CAP_BPF"},
		{"user namespace", &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: nobody, Size: 1}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: nobody, Size: 1}},
		}, "in a user namespace"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := failingDoctor(t, exe, nil, tt.attr, "--policy", policyCopy, "--unit", unitCopy)
			wantStatus(t, r, "privileges", statusFail, tt.privileges)
			for _, name := range []string{"bpf map types", "bpf prog types", "bpf helpers", "bpf attach", "bpf isa", "datapath load"} {
				wantStatus(t, r, name, statusFail, "not permitted to probe")
			}
			// What needs no privilege is still checked.
			for _, name := range []string{"kernel", "btf", "cgroup v2", "bpffs", "unit caps", "policy"} {
				wantStatus(t, r, name, statusPass)
			}
		})
	}
}

// TestDoctorInPod runs doctor as in a pod whose DaemonSet left PERFMON
// out: with the variable the kubelet sets, and holding BPF and NET_ADMIN
// alone (as uid 65534 with them ambient: the capabilities are what
// doctor reads). It fails with the DaemonSet's fix, and neither looks
// for a unit nor asks for systemd.
func TestDoctorInPod(t *testing.T) {
	privtest.RequireRoot(t)
	const nobody = 65534
	exe, dir := publicCopy(t)
	policyCopy := filepath.Join(dir, "policy.yaml")
	b, err := os.ReadFile(repoPolicy)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(policyCopy, b, 0o644); err != nil {
		t.Fatal(err)
	}
	r := failingDoctor(t, exe, []string{"KUBERNETES_SERVICE_HOST=10.96.0.1"}, &syscall.SysProcAttr{
		Credential:  &syscall.Credential{Uid: nobody, Gid: nobody},
		AmbientCaps: []uintptr{unix.CAP_BPF, unix.CAP_NET_ADMIN},
	}, "--policy", policyCopy)
	wantStatus(t, r, "privileges", statusFail, "lacks CAP_PERFMON")
	if c := r.find(t, "privileges"); !strings.Contains(c.Detail, "lacks CAP_PERFMON:") || !strings.Contains(c.Fix, "add PERFMON to the DaemonSet's securityContext.capabilities.add") {
		t.Errorf("privileges: %q, fix %q; want PERFMON alone missing, and the DaemonSet's fix", c.Detail, c.Fix)
	}
	wantStatus(t, r, "unit caps", statusInfo, "in a Kubernetes pod")
	wantStatus(t, r, "systemd", statusInfo, "in a Kubernetes pod")
}

// In a pod, a unit named with --unit is still checked.
func TestDoctorUnitInPod(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
	if c := checkUnitCaps(repoUnit); c.Status != statusPass {
		t.Errorf("--unit %s in a pod: %s (%s), want it checked", repoUnit, c.Status, c.Detail)
	}
}

// failingDoctor runs `egressd doctor --json` in a child with attr, the
// environment and env, and returns its report; it must exit 1, saying
// nothing on stderr.
func failingDoctor(t *testing.T, exe string, env []string, attr *syscall.SysProcAttr, args ...string) doctorReport {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), exe, append([]string{"--socket", absentSocket, "doctor", "--json"}, args...)...)
	cmd.Env = append(append(os.Environ(), doctorChildEnv+"=1"), env...)
	cmd.SysProcAttr = attr
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("doctor: %v, want exit status 1; stderr:\n%s", err, stderr.String())
	}
	if stderr.Len() > 0 {
		t.Errorf("stderr:\n%s", stderr.String())
	}
	var r doctorReport
	if err := json.Unmarshal(stdout.Bytes(), &r); err != nil {
		t.Fatalf("no JSON report (%v):\n%s", err, stdout.String())
	}
	if r.CanRun {
		t.Error("canRun without the privileges to tell")
	}
	return r
}

// publicCopy copies the test binary where an unprivileged user can run
// it (go test keeps it in a directory only root may enter).
func publicCopy(t *testing.T) (exe, dir string) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err = os.MkdirTemp("", "egressd-doctor-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	exe = filepath.Join(dir, "cli.test")
	dst, err := os.OpenFile(exe, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
	return exe, dir
}

// TestRequiredCapsMatchUnit: doctor asks of the unit what the unit in
// this repository grants, read the way doctor reads units.
func TestRequiredCapsMatchUnit(t *testing.T) {
	b, err := os.ReadFile(repoUnit)
	if err != nil {
		t.Fatal(err)
	}
	u := parseUnitCaps(string(b))
	var want uint64
	for _, c := range requiredCaps {
		want |= 1 << capBit(c)
	}
	if u.bounding != want || u.ambient != want {
		t.Errorf("unit grants bounding %#x, ambient %#x; doctor requires %#x (%v)", u.bounding, u.ambient, want, requiredCaps)
	}
}

func TestParseUnitCaps(t *testing.T) {
	bits := func(names ...string) uint64 {
		var s uint64
		for _, n := range names {
			s |= 1 << capBit(n)
		}
		return s
	}
	for _, tt := range []struct {
		name              string
		texts             []string
		bounding, ambient uint64
		user              string
	}{
		{"unset", []string{"[Service]\nType=notify\n"}, allCaps, 0, ""},
		{"list", []string{"[Service]\nCapabilityBoundingSet=CAP_BPF CAP_NET_ADMIN\n"}, bits("CAP_BPF", "CAP_NET_ADMIN"), 0, ""},
		{"lists add up", []string{"[Service]\nCapabilityBoundingSet=CAP_BPF\nCapabilityBoundingSet=CAP_PERFMON\n"}, bits("CAP_BPF", "CAP_PERFMON"), 0, ""},
		{"drop-in adds", []string{"[Service]\nCapabilityBoundingSet=CAP_BPF\n", "[Service]\nCapabilityBoundingSet=CAP_CHOWN\n"}, bits("CAP_BPF", "CAP_CHOWN"), 0, ""},
		{"drop-in takes away", []string{"[Service]\nCapabilityBoundingSet=CAP_BPF CAP_PERFMON\n", "[Service]\nCapabilityBoundingSet=~CAP_PERFMON\n"}, bits("CAP_BPF"), 0, ""},
		{"empty resets", []string{"[Service]\nCapabilityBoundingSet=CAP_BPF\n", "[Service]\nCapabilityBoundingSet=\n"}, 0, 0, ""},
		{"deny list", []string{"[Service]\nCapabilityBoundingSet=~CAP_SYS_ADMIN\n"}, allCaps &^ bits("CAP_SYS_ADMIN"), 0, ""},
		{"ambient and user", []string{"[Service]\nUser=egressd\nAmbientCapabilities=CAP_BPF\n"}, allCaps, bits("CAP_BPF"), "egressd"},
		{"other sections", []string{"[Unit]\nCapabilityBoundingSet=CAP_BPF\n[Service]\n# CapabilityBoundingSet=CAP_CHOWN\n"}, allCaps, 0, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			u := parseUnitCaps(tt.texts...)
			if u.bounding != tt.bounding || u.ambient != tt.ambient || u.user != tt.user {
				t.Errorf("got bounding %#x ambient %#x user %q, want %#x %#x %q", u.bounding, u.ambient, u.user, tt.bounding, tt.ambient, tt.user)
			}
		})
	}
}

func TestFlockHolder(t *testing.T) {
	locks := "1: POSIX  ADVISORY  WRITE 900 00:1e:77 0 EOF\n" +
		"2: FLOCK  ADVISORY  WRITE 1234 00:1e:4567 0 EOF\n" +
		"2: -> FLOCK  ADVISORY  WRITE 5678 00:1e:4567 0 EOF\n" +
		"3: FLOCK  ADVISORY  WRITE 42 fd:01:4567 0 EOF\n"
	for _, tt := range []struct {
		major, minor uint32
		ino          uint64
		want         int
	}{
		{0, 0x1e, 4567, 1234},
		{0xfd, 1, 4567, 42},
		{0, 0x1e, 77, 0}, // a POSIX lock is not the loader's
		{0, 0x1f, 4567, 0},
	} {
		if got := flockHolder(locks, tt.major, tt.minor, tt.ino); got != tt.want {
			t.Errorf("flockHolder(%x:%x:%d) = %d, want %d", tt.major, tt.minor, tt.ino, got, tt.want)
		}
	}
}

func TestUnitOf(t *testing.T) {
	for _, tt := range []struct{ cgroup, want string }{
		{"0::/system.slice/egressd.service\n", "egressd.service"},
		{"12:pids:/x\n0::/system.slice/egressd.service/sub\n", "egressd.service"},
		{"0::/user.slice/user-1000.slice/session-3.scope\n", ""},
	} {
		if got := unitOf(tt.cgroup); got != tt.want {
			t.Errorf("unitOf(%q) = %q, want %q", tt.cgroup, got, tt.want)
		}
	}
}

func TestKernelVersion(t *testing.T) {
	for _, tt := range []struct {
		release string
		want    [2]int
		ok      bool
	}{
		{"6.1.0-13-amd64", [2]int{6, 1}, true},
		{"5.18.0", [2]int{5, 18}, true},
		{"6.18.44-fc-v782", [2]int{6, 18}, true},
		{"5.4rc1", [2]int{5, 4}, true},
		{"weird", [2]int{}, false},
	} {
		got, ok := kernelVersion(tt.release)
		if got != tt.want || ok != tt.ok {
			t.Errorf("kernelVersion(%q) = %v %v, want %v %v", tt.release, got, ok, tt.want, tt.ok)
		}
	}
}

func TestCapEffAndUserNS(t *testing.T) {
	eff, ok := capEff("Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n")
	if !ok || eff != 1<<41-1 {
		t.Errorf("capEff = %#x %v", eff, ok)
	}
	if _, ok := capEff("Name:\tx\n"); ok {
		t.Error("capEff without CapEff")
	}
	if !initialUserNS("         0          0 4294967295\n") {
		t.Error("the initial identity map is not the initial namespace")
	}
	if initialUserNS("         0      65534          1\n") {
		t.Error("a one-id map taken for the initial namespace")
	}
}

// TestDoctorChecksDocumented: docs/install.md explains every check doctor
// makes, by the name it prints.
func TestDoctorChecksDocumented(t *testing.T) {
	r := runDoctor(t.Context(), doctorConfig{PinDir: filepath.Join(t.TempDir(), "pins"), Policy: repoPolicy, Unit: repoUnit, Client: &control.Client{Socket: absentSocket}})
	var names []string
	for _, c := range r.Checks {
		names = append(names, c.Name)
	}
	docstest.Mentions(t, filepath.Join("..", "..", "docs", "install.md"), names...)
}

// The systemd check's fix runs the daemon with the policy doctor was
// given, not the default one.
func TestSystemdFixNamesPolicy(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // in a pod (a CI runner's), systemd is not asked for
	c := checkSystemd("/srv/egressd/fleet.yaml")
	if c.Status == statusPass {
		t.Skip("systemd is the init system here: the check passes and proposes no fix")
	}
	if want := "egressd run --policy /srv/egressd/fleet.yaml"; !strings.Contains(c.Fix, want) {
		t.Errorf("fix %q, want it to say %q", c.Fix, want)
	}
}
