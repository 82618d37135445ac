package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/bpffs"
	"github.com/egressd/egressd/internal/daemon"
	"github.com/egressd/egressd/pkg/cgroups"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

func doctorCommand() *cli.Command {
	return &cli.Command{
		Name:  "doctor",
		Usage: "check whether this host can run the daemon, and say how to fix what it lacks",
		Description: "Probes the kernel for every BPF feature the datapath uses (by loading small test programs, " +
			"then the datapath itself, attaching nothing), and checks BTF, cgroup v2, bpffs, the unit's capabilities, " +
			"the policy file, a pinned datapath and who holds it, the control socket and systemd. " +
			"Run it as root: without the daemon's privileges the probes cannot tell. " +
			"Exits 0 when the daemon can run here (warnings allowed), 1 when a check fails.",
		Flags: []cli.Flag{
			jsonFlag,
			&cli.StringFlag{Name: "bpffs", Value: loader.DefaultPinDir, Usage: "bpffs directory of the datapath's pins"},
			&cli.StringFlag{Name: "cgroup", DefaultText: "the cgroup2 root, the whole host", Usage: "cgroup v2 directory the daemon attaches to"},
			&cli.StringFlag{Name: "policy", Value: daemon.DefaultPolicyFile, Usage: "policy file the daemon reads"},
			&cli.StringFlag{Name: "unit", DefaultText: "the installed egressd.service and its drop-ins", Usage: "systemd unit file to check"},
		},
		Action: func(c *cli.Context) error {
			r := runDoctor(c.Context, doctorConfig{
				PinDir: c.String("bpffs"),
				Cgroup: c.String("cgroup"),
				Policy: c.String("policy"),
				Unit:   c.String("unit"),
				Client: client(c),
			})
			if err := output(c, r, r.print); err != nil {
				return err
			}
			if !r.CanRun {
				return cli.Exit("", 1)
			}
			return nil
		},
	}
}

// Check outcomes. Info is a fact that needs no action (no daemon running
// yet); a warning needs a look but does not keep the daemon from running.
const (
	statusPass = "pass"
	statusInfo = "info"
	statusWarn = "warn"
	statusFail = "fail"
)

type check struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

type feature struct {
	Kind  string   `json:"kind"`
	Name  string   `json:"name"`
	Used  []string `json:"usedBy,omitempty"`
	OK    bool     `json:"ok"`
	Error string   `json:"error,omitempty"`
}

type doctorReport struct {
	// CanRun is false when any check failed.
	CanRun   bool      `json:"canRun"`
	Checks   []check   `json:"checks"`
	Features []feature `json:"features"`
}

type doctorConfig struct {
	PinDir, Cgroup, Policy, Unit string
	Client                       *control.Client
}

func runDoctor(ctx context.Context, cfg doctorConfig) doctorReport {
	var r doctorReport
	add := func(c check) { r.Checks = append(r.Checks, c) }
	add(checkKernel())
	add(checkPrivileges())
	features := loader.ProbeFeatures()
	for _, f := range features {
		fe := feature{Kind: f.Kind, Name: f.Name, Used: f.Used, OK: f.Err == nil}
		if f.Err != nil {
			fe.Error = f.Err.Error()
		}
		r.Features = append(r.Features, fe)
	}
	for _, kind := range featureKinds {
		add(checkFeatures(kind, features))
	}
	add(checkCgroup2(cfg.Cgroup))
	add(checkBPFFS(cfg.PinDir))
	add(checkUnitCaps(cfg.Unit))
	add(checkPolicy(cfg.Policy))
	add(checkPinned(cfg.PinDir, cfg.Cgroup))
	add(checkSocket(ctx, cfg.Client))
	add(checkSystemd(cfg.Policy))
	r.CanRun = !slices.ContainsFunc(r.Checks, func(c check) bool { return c.Status == statusFail })
	return r
}

func (r doctorReport) print(w io.Writer) {
	var warnings, failures int
	for _, c := range r.Checks {
		fmt.Fprintf(w, "%-4s  %-16s %s\n", strings.ToUpper(c.Status), c.Name, c.Detail)
		if c.Fix != "" {
			fmt.Fprintf(w, "%-4s  %-16s fix: %s\n", "", "", c.Fix)
		}
		switch c.Status {
		case statusWarn:
			warnings++
		case statusFail:
			failures++
		}
	}
	if r.CanRun {
		fmt.Fprintf(w, "egressd can run on this host (%d warning(s))\n", warnings)
	} else {
		fmt.Fprintf(w, "egressd cannot run on this host: %d check(s) failed, %d warning(s)\n", failures, warnings)
	}
}

// minKernel is the oldest kernel with everything the datapath uses
// (bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS) came last, in 6.12). The
// version alone decides nothing: the probes do.
var minKernel = [2]int{6, 12}

func checkKernel() check {
	c := check{Name: "kernel"}
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		c.Status, c.Detail = statusFail, "uname: "+err.Error()
		return c
	}
	release, machine := unix.ByteSliceToString(u.Release[:]), unix.ByteSliceToString(u.Machine[:])
	v, ok := kernelVersion(release)
	switch {
	case !ok:
		c.Status, c.Detail = statusWarn, fmt.Sprintf("Linux %s (%s): cannot read the version; the probes below decide", release, machine)
	case v[0] < minKernel[0] || v[0] == minKernel[0] && v[1] < minKernel[1]:
		c.Status = statusWarn
		c.Detail = fmt.Sprintf("Linux %s (%s) is older than %d.%d, where the datapath's newest need arrived; the probes below say whether it was backported", release, machine, minKernel[0], minKernel[1])
		c.Fix = fmt.Sprintf("run a kernel >= %d.%d (Debian 13's 6.12 or later)", minKernel[0], minKernel[1])
	default:
		c.Status, c.Detail = statusPass, fmt.Sprintf("Linux %s (%s); each feature is probed below", release, machine)
	}
	return c
}

// kernelVersion reads "6.1.0-13-amd64" as [6 1].
func kernelVersion(release string) ([2]int, bool) {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return [2]int{}, false
	}
	digits := func(s string) string {
		if i := strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
			return s[:i]
		}
		return s
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(digits(parts[1]))
	if err1 != nil || err2 != nil {
		return [2]int{}, false
	}
	return [2]int{major, minor}, true
}

// requiredCaps are what the datapath needs (systemd/egressd.service says
// why; internal/unitcheck proves each is needed and enough).
var requiredCaps = []string{"CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"}

const runAsRoot = "run it as root: sudo egressd doctor"

func checkPrivileges() check {
	c := check{Name: "privileges"}
	if m, err := os.ReadFile("/proc/self/uid_map"); err == nil && !initialUserNS(string(m)) {
		c.Status = statusFail
		c.Detail = fmt.Sprintf("in a user namespace (uid_map %q): its capabilities do not reach the kernel's BPF, so the probes cannot tell", strings.Join(strings.Fields(string(m)), " "))
		c.Fix = "run egressd doctor on the host, as root"
		return c
	}
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		c.Status, c.Detail, c.Fix = statusFail, "read /proc/self/status: "+err.Error(), runAsRoot
		return c
	}
	eff, ok := capEff(string(status))
	if !ok {
		c.Status, c.Detail, c.Fix = statusFail, "no CapEff in /proc/self/status", runAsRoot
		return c
	}
	var missing []string
	for _, name := range requiredCaps {
		if eff&(1<<capBit(name)) == 0 {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		c.Status = statusFail
		c.Detail = fmt.Sprintf("uid %d lacks %s: the probes load BPF programs, which needs them, so they cannot tell", os.Geteuid(), strings.Join(missing, ", "))
		c.Fix = runAsRoot
		if inPod() {
			// Kubernetes spells capabilities without CAP_, and grants
			// no ambient ones: a process of another uid has none.
			var names []string
			for _, m := range missing {
				names = append(names, strings.TrimPrefix(m, "CAP_"))
			}
			c.Fix = "add " + strings.Join(names, ", ") + " to the DaemonSet's securityContext.capabilities.add " +
				"(deploy/kubernetes/30-daemonset.yaml), and keep runAsUser: 0"
		}
		return c
	}
	c.Status, c.Detail = statusPass, fmt.Sprintf("uid %d with %s", os.Geteuid(), strings.Join(requiredCaps, ", "))
	return c
}

// inPod reports whether egressd runs in a Kubernetes pod, where no
// systemd unit applies and the DaemonSet grants the capabilities. The
// kubelet sets KUBERNETES_SERVICE_HOST in every container it starts,
// whatever the runtime, `kubectl exec` passes it on, and the daemon's
// in-cluster config reads it. Marker files are no proof: /.dockerenv
// outlives a Docker image made into a VM's root file system, and
// containerd leaves none; nor is /proc/1/cgroup, "0::/" in a container's
// own cgroup namespace and on a host whose init is not systemd.
func inPod() bool { return os.Getenv("KUBERNETES_SERVICE_HOST") != "" }

// initialUserNS reports whether a uid_map is the initial namespace's
// identity map.
func initialUserNS(uidMap string) bool {
	return strings.Join(strings.Fields(uidMap), " ") == "0 0 4294967295"
}

// capEff reads the effective capability mask from /proc/PID/status.
func capEff(status string) (uint64, bool) {
	for line := range strings.Lines(status) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// featureKinds are loader.ProbeFeatures' kinds, one check each, in order.
var featureKinds = []string{
	loader.FeatureBTF, loader.FeatureMapType, loader.FeatureProgramType, loader.FeatureHelper,
	loader.FeatureAttach, loader.FeatureISA, loader.FeatureLoad,
}

var featureCheckNames = map[string]string{
	loader.FeatureBTF:         "btf",
	loader.FeatureMapType:     "bpf map types",
	loader.FeatureProgramType: "bpf prog types",
	loader.FeatureHelper:      "bpf helpers",
	loader.FeatureAttach:      "bpf attach",
	loader.FeatureISA:         "bpf isa",
	loader.FeatureLoad:        "datapath load",
}

const newerKernel = "run a kernel >= 6.12 built with CONFIG_BPF_SYSCALL, CONFIG_CGROUP_BPF and CONFIG_BPF_JIT (Debian 13's 6.12 has them all)"

func checkFeatures(kind string, features []loader.Feature) check {
	c := check{Name: featureCheckNames[kind]}
	var have, missing, unknown, denied []string
	for _, f := range features {
		if f.Kind != kind {
			continue
		}
		switch {
		case f.Err == nil:
			have = append(have, f.Name)
		case errors.Is(f.Err, loader.ErrNotSupported):
			missing = append(missing, fmt.Sprintf("%s (used by %s): %v", f.Name, strings.Join(f.Used, ", "), f.Err))
		case errors.Is(f.Err, fs.ErrPermission):
			denied = append(denied, f.Name)
		default:
			unknown = append(unknown, fmt.Sprintf("%s: %v", f.Name, f.Err))
		}
	}
	switch {
	case len(missing) > 0:
		c.Status, c.Detail = statusFail, "missing: "+strings.Join(missing, "; ")
		c.Fix = newerKernel
		if kind == loader.FeatureBTF {
			c.Fix = "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (Debian's are)"
		}
	case len(unknown) > 0:
		c.Status, c.Detail = statusFail, "could not probe: "+strings.Join(unknown, "; ")
		c.Fix = "report it with the output of `egressd doctor --json`"
	case len(denied) > 0:
		c.Status, c.Detail, c.Fix = statusFail, "not permitted to probe "+strings.Join(denied, ", "), runAsRoot
		if kind == loader.FeatureHelper {
			c.Detail = fmt.Sprintf("not permitted to probe %d helper/program type pairs", len(denied))
		}
	case len(have) == 0:
		c.Status, c.Detail = statusFail, "nothing probed"
	case kind == loader.FeatureHelper:
		c.Status, c.Detail = statusPass, fmt.Sprintf("%d helper/program type pairs (--json lists them)", len(have))
	default:
		c.Status, c.Detail = statusPass, strings.Join(have, ", ")
	}
	return c
}

func checkCgroup2(cgroup string) check {
	c := check{Name: "cgroup v2"}
	root, err := cgroups.Mount()
	if err != nil {
		c.Status, c.Detail = statusFail, err.Error()
		c.Fix = "boot with systemd.unified_cgroup_hierarchy=1, or mount one: mount -t cgroup2 none /sys/fs/cgroup/unified"
		return c
	}
	c.Detail = "mounted at " + root
	if root != "/sys/fs/cgroup" {
		c.Detail += " (a hybrid host: cgroup v1 hierarchies beside it)"
	}
	dir, err := cgroups.Resolve(cgroup)
	if err == nil {
		_, err = cgroups.ID(dir)
	}
	if err != nil {
		c.Status, c.Detail = statusFail, c.Detail+"; the daemon's cgroup: "+err.Error()
		c.Fix = "give --cgroup an existing cgroup v2 directory"
		return c
	}
	if dir != root {
		c.Detail += "; the daemon attaches to " + dir
	}
	c.Status = statusPass
	return c
}

func checkBPFFS(pinDir string) check {
	c := check{Name: "bpffs"}
	parent := bpffs.Root(pinDir)
	mounted, err := bpffs.Mounted(parent)
	if err != nil {
		c.Status, c.Detail = statusFail, fmt.Sprintf("%s: %v", parent, err)
		c.Fix = "mount -t bpf bpffs " + parent
		return c
	}
	if !mounted {
		c.Status = statusFail
		c.Detail = parent + " is not a bpffs: the pins that keep enforcement across restarts have nowhere to live"
		c.Fix = "mount -t bpf bpffs " + parent + " (systemd does at boot; the unit cannot, holding no CAP_SYS_ADMIN)"
		return c
	}
	c.Status, c.Detail = statusPass, "mounted at "+parent+"; pins go in "+pinDir
	return c
}

// unitDirs are where systemd looks for units, most important first.
var unitDirs = []string{"/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system"}

const unitName = "egressd.service"

// checkUnitCaps checks the unit at path, or the installed one when path
// is empty; in a pod there is none to look for.
func checkUnitCaps(path string) check {
	c := check{Name: "unit caps"}
	if path == "" && inPod() {
		c.Status = statusInfo
		c.Detail = "in a Kubernetes pod: no systemd unit applies; the DaemonSet grants the capabilities (see privileges)"
		return c
	}
	files, err := unitFiles(path)
	if err != nil {
		c.Status, c.Detail = statusFail, err.Error()
		return c
	}
	if len(files) == 0 {
		c.Status = statusInfo
		c.Detail = "no " + unitName + " installed: fine for `egressd run` by hand"
		return c
	}
	if target, err := os.Readlink(files[0]); err == nil && target == os.DevNull {
		c.Status, c.Detail, c.Fix = statusFail, files[0]+" masks the unit", "systemctl unmask egressd"
		return c
	}
	var texts []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			c.Status, c.Detail = statusFail, err.Error()
			return c
		}
		texts = append(texts, string(b))
	}
	u := parseUnitCaps(texts...)
	lacks := func(set uint64) []string {
		var out []string
		for _, name := range requiredCaps {
			if set&(1<<capBit(name)) == 0 {
				out = append(out, name)
			}
		}
		return out
	}
	from := strings.Join(files, " + ")
	if missing := lacks(u.bounding); len(missing) > 0 {
		c.Status = statusFail
		c.Detail = fmt.Sprintf("%s: CapabilityBoundingSet= lacks %s", from, strings.Join(missing, ", "))
		c.Fix = "systemctl edit egressd: CapabilityBoundingSet=" + strings.Join(requiredCaps, " ")
		return c
	}
	if missing := lacks(u.ambient); u.user != "" && u.user != "root" && u.user != "0" && len(missing) > 0 {
		c.Status = statusFail
		c.Detail = fmt.Sprintf("%s: User=%s with AmbientCapabilities= lacking %s", from, u.user, strings.Join(missing, ", "))
		c.Fix = "systemctl edit egressd: AmbientCapabilities=" + strings.Join(requiredCaps, " ")
		return c
	}
	if last := lastCap(); last >= 0 && last < capBit("CAP_BPF") {
		c.Status = statusFail
		c.Detail = fmt.Sprintf("this kernel knows capabilities up to %d; CAP_BPF and CAP_PERFMON (5.8) are not among them", last)
		c.Fix = newerKernel
		return c
	}
	c.Status, c.Detail = statusPass, fmt.Sprintf("%s grants %s", from, strings.Join(requiredCaps, ", "))
	return c
}

// unitFiles returns the unit file systemd would load and then its
// drop-ins in the order it applies them; none when no unit is installed.
func unitFiles(path string) ([]string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return nil, err
		}
		return []string{path}, nil
	}
	var unit string
	dropins := map[string]string{}
	for _, dir := range unitDirs {
		p := filepath.Join(dir, unitName)
		if _, err := os.Lstat(p); err == nil && unit == "" {
			unit = p
		}
		confs, _ := filepath.Glob(filepath.Join(dir, unitName+".d", "*.conf"))
		for _, conf := range confs {
			// A drop-in in a more important directory hides one of the
			// same name in a less important one.
			if _, ok := dropins[filepath.Base(conf)]; !ok {
				dropins[filepath.Base(conf)] = conf
			}
		}
	}
	if unit == "" {
		return nil, nil
	}
	out := []string{unit}
	for _, name := range slices.Sorted(maps.Keys(dropins)) {
		out = append(out, dropins[name])
	}
	return out, nil
}

type unitCaps struct {
	bounding, ambient uint64
	user              string
}

// parseUnitCaps applies the [Service] capability settings of a unit and
// its drop-ins as systemd does (config_parse_capability_set): an empty
// or "~"-only value, or the first one, replaces the set; a later list
// adds to it, a later "~list" takes from it. The bounding set starts
// full, the ambient one empty.
func parseUnitCaps(texts ...string) unitCaps {
	u := unitCaps{bounding: allCaps}
	for _, text := range texts {
		section := ""
		for line := range strings.Lines(text) {
			line = strings.TrimSpace(line)
			if strings.HasPrefix(line, "[") {
				section = strings.Trim(line, "[]")
				continue
			}
			key, value, ok := strings.Cut(line, "=")
			if !ok || section != "Service" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") {
				continue
			}
			switch strings.TrimSpace(key) {
			case "CapabilityBoundingSet":
				u.bounding = applyCaps(u.bounding, allCaps, strings.TrimSpace(value))
			case "AmbientCapabilities":
				u.ambient = applyCaps(u.ambient, 0, strings.TrimSpace(value))
			case "User":
				u.user = strings.TrimSpace(value)
			}
		}
	}
	return u
}

func applyCaps(set, initial uint64, value string) uint64 {
	invert := strings.HasPrefix(value, "~")
	var sum uint64
	for _, name := range strings.Fields(strings.TrimPrefix(value, "~")) {
		if bit := capBit(name); bit >= 0 {
			sum |= 1 << bit
		}
	}
	switch {
	case sum == 0 || set == initial:
		if invert {
			return allCaps &^ sum
		}
		return sum
	case invert:
		return set &^ sum
	}
	return set | sum
}

// capNames are capabilities(7)'s, by bit number.
var capNames = []string{
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

var allCaps = uint64(1)<<len(capNames) - 1

// capBit returns a capability's bit number, or -1 for an unknown name.
func capBit(name string) int {
	return slices.Index(capNames, strings.ToUpper(name))
}

// lastCap is the kernel's highest capability number, or -1 if unknown.
func lastCap() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return n
}

func checkPolicy(path string) check {
	c := check{Name: "policy"}
	p, err := policy.Load(path)
	var pe *policy.Error
	switch {
	case errors.Is(err, os.ErrNotExist) && path == daemon.DefaultPolicyFile:
		c.Status, c.Detail = statusInfo, path+" does not exist: the daemon starts with no rules"
	case errors.Is(err, os.ErrNotExist):
		c.Status, c.Detail, c.Fix = statusFail, err.Error(), "write the policy, or drop --policy to use "+daemon.DefaultPolicyFile
	case errors.As(err, &pe):
		c.Status = statusFail
		c.Detail = fmt.Sprintf("%s has %d problem(s), so the daemon will not start: %s", path, len(pe.Problems), strings.Join(splitLines(pe.Error()), "; "))
		c.Fix = "egressd policy check " + path
	case err != nil:
		c.Status, c.Detail = statusFail, err.Error()
	default:
		c.Status, c.Detail = statusPass, fmt.Sprintf("%s: %d rule(s)", path, len(p.Rules))
	}
	return c
}

func checkPinned(pinDir, cgroup string) check {
	c := check{Name: "datapath"}
	p, err := loader.InspectPins(pinDir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		c.Status, c.Detail = statusInfo, "nothing pinned at "+pinDir+": the daemon will load a fresh datapath"
		return c
	case errors.Is(err, fs.ErrPermission):
		c.Status, c.Detail, c.Fix = statusFail, "cannot look at "+pinDir+": "+err.Error(), runAsRoot
		return c
	case err != nil:
		c.Status, c.Detail = statusFail, "pinned at "+pinDir+", unreadable: "+err.Error()
		c.Fix = "egressd uninstall (removes the pins, ending enforcement)"
		return c
	}
	want, err := cgroups.Resolve(cgroup)
	var wantID uint64
	if err == nil {
		wantID, err = cgroups.ID(want)
	}
	if err != nil {
		c.Status, c.Detail = statusFail, "the daemon's cgroup: "+err.Error()
		return c
	}
	var names []string
	var elsewhere []string
	for _, l := range p.Links {
		names = append(names, l.Name)
		if l.CgroupID != wantID {
			elsewhere = append(elsewhere, fmt.Sprintf("%s on %s", l.Name, cgroupPath(l.CgroupID)))
		}
	}
	c.Detail = fmt.Sprintf("pinned at %s: %d map(s), %d rule slots, links %s", pinDir, p.Maps, p.MaxRules, strings.Join(names, ", "))
	if len(p.Links) == 0 {
		c.Detail = fmt.Sprintf("pinned at %s: %d map(s) and no links, so nothing is enforced", pinDir, p.Maps)
	} else if len(elsewhere) == 0 {
		c.Detail += " on " + describeCgroup(want)
	}
	holder := lockHolder(pinDir)
	c.Detail += "; " + holder.String()
	switch {
	case p.Incompatible != nil:
		c.Status = statusFail
		c.Detail += fmt.Sprintf("; this build cannot adopt it: %v", p.Incompatible)
		c.Fix = "egressd uninstall (ends enforcement until the daemon starts), then start the daemon"
	case len(elsewhere) > 0:
		c.Status = statusFail
		c.Detail += fmt.Sprintf("; attached elsewhere than the daemon's %s: %s", want, strings.Join(elsewhere, ", "))
		c.Fix = "egressd uninstall, or run the daemon with the --cgroup it was pinned for"
	case holder.pid == 0 && len(p.Links) > 0:
		c.Status = statusWarn
		c.Fix = "start the daemon (systemctl start egressd), which adopts it; or end enforcement: egressd uninstall"
	default:
		c.Status = statusPass
	}
	return c
}

func describeCgroup(dir string) string {
	if root, err := cgroups.Mount(); err == nil && dir == root {
		return "the whole host (" + dir + ")"
	}
	return dir
}

// cgroupPath finds the directory of a cgroup id below the cgroup2 root.
func cgroupPath(id uint64) string {
	root, err := cgroups.Mount()
	if err != nil {
		return fmt.Sprintf("cgroup id %d", id)
	}
	found := fmt.Sprintf("cgroup id %d (gone)", id)
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if got, err := cgroups.ID(path); err == nil && got == id {
			found = path
			return filepath.SkipAll
		}
		return nil
	})
	return found
}

// holder is the process holding a pin directory's lock: the daemon that
// has the datapath open (loader.Open takes an exclusive flock on it).
type holder struct {
	pid     int
	cmdline string
	unit    string
	err     error
}

func (h holder) String() string {
	switch {
	case h.err != nil:
		return "who holds it is unknown: " + h.err.Error()
	case h.pid == 0:
		return "no process holds it: it enforces without a daemon (fail-static), its limits fixed as last set"
	}
	s := fmt.Sprintf("held by pid %d (%s)", h.pid, h.cmdline)
	if h.unit != "" {
		s += " of " + h.unit
	}
	return s
}

func lockHolder(dir string) holder {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return holder{err: err}
	}
	locks, err := os.ReadFile("/proc/locks")
	if err != nil {
		return holder{err: err}
	}
	pid := flockHolder(string(locks), unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	if pid == 0 {
		return holder{}
	}
	h := holder{pid: pid}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil {
		h.cmdline = strings.TrimSpace(string(bytes.ReplaceAll(b, []byte{0}, []byte{' '})))
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		h.unit = unitOf(string(b))
	}
	return h
}

// flockHolder finds the pid holding a FLOCK on the inode in /proc/locks,
// whose lines read "1: FLOCK  ADVISORY  WRITE 1234 00:1e:5678 0 EOF"
// (major and minor in hex); 0 when none does.
func flockHolder(locks string, major, minor uint32, ino uint64) int {
	want := fmt.Sprintf("%02x:%02x:%d", major, minor, ino)
	for line := range strings.Lines(locks) {
		f := strings.Fields(line)
		if len(f) < 6 || f[1] != "FLOCK" {
			continue // "->" lines are waiters, not holders
		}
		if f[5] == want {
			pid, _ := strconv.Atoi(f[4])
			return pid
		}
	}
	return 0
}

// unitOf names the systemd service of a /proc/PID/cgroup, if any.
func unitOf(cgroup string) string {
	for line := range strings.Lines(cgroup) {
		if path, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			for _, part := range slices.Backward(strings.Split(path, "/")) {
				if strings.HasSuffix(part, ".service") {
					return part
				}
			}
		}
	}
	return ""
}

func checkSocket(ctx context.Context, cl *control.Client) check {
	c := check{Name: "control socket"}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := cl.Status(ctx)
	switch {
	case control.IsNotRunning(err):
		c.Status, c.Detail = statusInfo, "no daemon answers: "+err.Error()
	case control.IsAccessDenied(err):
		c.Status, c.Detail = statusWarn, err.Error()
		c.Fix = "run as root, or add this user to the daemon's --socket-group"
	case err != nil:
		c.Status, c.Detail = statusFail, "the socket does not answer as it should: "+err.Error()
		c.Fix = "systemctl restart egressd (the datapath stays enforcing meanwhile)"
	default:
		c.Status = statusPass
		c.Detail = fmt.Sprintf("egressd %s answers, up %s, %d rule(s), %d pending", s.Version, time.Since(s.Started).Round(time.Second), s.Rules, s.Pending)
	}
	return c
}

// minSystemd is the oldest systemd that knows every setting of the unit
// (ProtectProc= and ProcSubset= came in 247); older ones skip what they
// do not know, with a warning, and the daemon runs less confined.
const minSystemd = 247

// checkSystemd's fix names the policy file doctor was given, the one the
// daemon is to read.
func checkSystemd(policy string) check {
	c := check{Name: "systemd"}
	if policy == "" {
		policy = daemon.DefaultPolicyFile
	}
	if inPod() {
		c.Status, c.Detail = statusInfo, "in a Kubernetes pod: the kubelet runs the daemon, not systemd"
		return c
	}
	runIt := "run `egressd run --policy " + policy + "` under this host's service manager"
	out, err := exec.Command("systemctl", "--version").Output()
	if err != nil {
		c.Status, c.Detail = statusWarn, "no systemd (systemctl --version: "+err.Error()+")"
		c.Fix = runIt
		return c
	}
	version, _, _ := strings.Cut(string(out), "\n")
	var n int
	fmt.Sscanf(version, "systemd %d", &n)
	_, err = os.Stat("/run/systemd/system")
	running := err == nil
	switch {
	case !running:
		c.Status = statusWarn
		c.Detail = version + " is installed but not running as the init system here (a container, or another init): the unit cannot be started"
		c.Fix = runIt
	case n < minSystemd:
		c.Status = statusWarn
		c.Detail = fmt.Sprintf("%s: older than %d, it ignores some of the unit's confinement", version, minSystemd)
		c.Fix = "upgrade systemd, or accept a less confined daemon"
	default:
		c.Status, c.Detail = statusPass, version+", running"
	}
	return c
}
