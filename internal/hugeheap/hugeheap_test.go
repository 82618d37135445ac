package hugeheap

import (
	"bufio"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// region is reserved once a process, as the daemon does at start: a second
// would come after the first test's growth, not before it.
var region = sync.OnceValue(func() *Region { return Reserve(256 << 20) })

// TestRegionTakesGrowthInHugePages grows the heap by 64 MiB while a region
// is advised: the memory lands in the region and takes its pages 2 MiB at
// a time. Once withdrawn, the region asks for no huge pages.
func TestRegionTakesGrowthInHugePages(t *testing.T) {
	if !Available() {
		overcommit, _ := os.ReadFile("/proc/sys/vm/overcommit_memory")
		t.Skipf("no region here: transparent huge pages %q (%s), vm.overcommit_memory %s", Mode(), ModeFile, overcommit)
	}
	r := region()
	if r == nil {
		t.Fatal("no region in madvise mode")
	}
	r.Advise()
	r.Advise()
	r.Withdraw()
	withdrawn := false
	t.Cleanup(func() {
		if !withdrawn {
			r.Withdraw()
		}
	})
	const n = 64 << 20
	before := minorFaults(t)
	b := make([]byte, n)
	for i := 0; i < n; i += 4096 {
		b[i] = 1
	}
	faults := minorFaults(t) - before
	// Most of it, at least: the first fit may begin in a few free pages
	// just below the region.
	p := uintptr(unsafe.Pointer(&b[0]))
	if inside := min(p+n, r.base+r.size) - max(p, r.base); p+n <= r.base || p >= r.base+r.size || inside < n-2<<20 {
		t.Fatalf("the heap grew at [%#x, %#x), not into the region [%#x, %#x)", p, p+n, r.base, r.base+r.size)
	}
	in := max(p, r.base) + 1<<20
	flags, huge := mapping(t, in)
	if !slices.Contains(flags, "hg") {
		t.Errorf("advised twice, withdrawn once: VmFlags %v, want hg", flags)
	}
	if huge < n/2 {
		t.Errorf("64 MiB touched: %d MiB of it in huge pages", huge>>20)
	}
	// 16,384 faults in 4 KiB pages; 32 in 2 MiB ones, and a few of the
	// runtime's own.
	if faults > n/4096/8 && !raceEnabled {
		t.Errorf("64 MiB touched: %d faults", faults)
	}
	if !r.Advised() {
		t.Error("advised twice, withdrawn once: Advised is false")
	}
	r.Withdraw()
	withdrawn = true
	if r.Advised() {
		t.Error("withdrawn: Advised is true")
	}
	if flags, _ := mapping(t, in); !slices.Contains(flags, "nh") || slices.Contains(flags, "hg") {
		t.Errorf("withdrawn: VmFlags %v, want nh", flags)
	}
	b[0]++
}

func TestRegionSize(t *testing.T) {
	const gib = 1 << 30
	for _, tt := range []struct {
		n    int
		ram  uint64
		want int
	}{
		{474 << 20, 24 * gib, 474 << 20},
		{4 * gib, 8 * gib, 2 * gib},
		{0, 24 * gib, 0},
		{-1, 24 * gib, 0},
	} {
		if got := regionSize(tt.n, tt.ram); got != tt.want {
			t.Errorf("regionSize(%d, %d) = %d, want %d", tt.n, tt.ram, got, tt.want)
		}
	}
}

func TestAvailable(t *testing.T) {
	for _, tt := range []struct {
		mode, overcommit string
		want             bool
	}{
		{"madvise", "0", true},
		{"madvise", "1", true},
		{"madvise", "2", false}, // strict accounting
		{"always", "0", false},  // huge pages anyway
		{"never", "0", false},
		{"", "0", false}, // no transparent huge pages
	} {
		if got := available(tt.mode, tt.overcommit); got != tt.want {
			t.Errorf("available(%q, %q) = %v, want %v", tt.mode, tt.overcommit, got, tt.want)
		}
	}
}

func TestNilRegion(t *testing.T) {
	var r *Region
	r.Advise()
	r.Withdraw()
	if Reserve(0) != nil {
		t.Error("Reserve(0) is a region")
	}
}

func minorFaults(t *testing.T) int64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return ru.Minflt
}

// mapping is the VmFlags and AnonHugePages of the mapping that holds p.
func mapping(t *testing.T, p uintptr) (flags []string, huge int) {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(fields[0], "-"); ok && !strings.HasSuffix(fields[0], ":") {
			a, errA := strconv.ParseUint(lo, 16, 64)
			b, errB := strconv.ParseUint(hi, 16, 64)
			if errA == nil && errB == nil {
				if in {
					break
				}
				in = uint64(p) >= a && uint64(p) < b
				continue
			}
		}
		if !in {
			continue
		}
		switch fields[0] {
		case "AnonHugePages:":
			kb, _ := strconv.Atoi(fields[1])
			huge = kb << 10
		case "VmFlags:":
			flags = fields[1:]
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if flags == nil {
		t.Fatalf("no mapping holds %#x", p)
	}
	return flags, huge
}
