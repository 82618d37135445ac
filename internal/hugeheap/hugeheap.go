// Package hugeheap lends the Go heap transparent huge pages while it grows
// fast: while the daemon reads and installs a large policy.
//
// On a virtual machine a page fault can be dear. On the machine of
// docs/bench.md the first touch of a 4 KiB page costs 13–17 µs, and a
// start with 100,000 rules touches about 50,000 new pages: 0.7 s of its
// 1.8 s. A 2 MiB page is one fault where 512 small pages are 512. The Go
// runtime does not advise its heap for huge pages, so where the kernel
// gives them only to memory that asks (transparent_hugepage "madvise",
// the default of many distributions) the heap never has them.
//
// A [Region] is address space of the heap: one large allocation, freed at
// once. The runtime reuses free heap pages, lowest address first, before
// it maps new ones, so the heap grows into the region. While the region is
// advised, a fault there takes a whole huge page. The advice is withdrawn
// after the burst, so that khugepaged does not later fill the idle heap's
// partly used 2 MiB ranges and raise the daemon's resident memory.
package hugeheap

import (
	"os"
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ModeFile is where the kernel says when it gives memory huge pages.
const ModeFile = "/sys/kernel/mm/transparent_hugepage/enabled"

// A Region is part of the heap's address space, advised for huge pages
// between Advise and Withdraw. A nil *Region does nothing.
type Region struct {
	base, size uintptr

	mu      sync.Mutex
	advised int // Advise calls not yet withdrawn
}

// Reserve makes up to n bytes of the heap's address space a region, at
// most a quarter of the RAM, far below what the kernel's overcommit
// heuristic refuses; nil where it is not [Available]. Call it while the
// heap is small, before the growth it is for: the allocation must come
// from memory never touched, which then stays untouched until the heap
// grows into it.
func Reserve(n int) *Region {
	if !Available() {
		return nil
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return nil
	}
	if n = regionSize(n, uint64(si.Totalram)*uint64(si.Unit)); n == 0 {
		return nil
	}
	b := make([]byte, n)
	// Only the address is kept: once b is freed the region is the heap's.
	r := &Region{base: uintptr(unsafe.Pointer(unsafe.SliceData(b))), size: uintptr(n)}
	runtime.KeepAlive(b)
	runtime.GC()
	return r
}

// regionSize is how much of n bytes to reserve on a machine of ram bytes.
func regionSize(n int, ram uint64) int {
	if n <= 0 {
		return 0
	}
	return int(min(uint64(n), ram/4))
}

// Available says whether a region changes anything here, and costs
// nothing but address space: the kernel gives huge pages only to memory
// that asks, and does not count address space strictly. Where it does
// (vm.overcommit_memory 2), a region, never freed, would hold that much of
// the commit limit, and an allocation over the limit ends the process.
func Available() bool {
	overcommit, err := os.ReadFile("/proc/sys/vm/overcommit_memory")
	return err == nil && available(Mode(), strings.TrimSpace(string(overcommit)))
}

func available(mode, overcommit string) bool {
	return mode == "madvise" && (overcommit == "0" || overcommit == "1")
}

// Mode is the kernel's transparent huge page mode: "always", "madvise" or
// "never"; empty without transparent huge pages.
func Mode() string {
	data, err := os.ReadFile(ModeFile)
	if err != nil {
		return ""
	}
	for _, f := range strings.Fields(string(data)) {
		if strings.HasPrefix(f, "[") && strings.HasSuffix(f, "]") {
			return strings.Trim(f, "[]")
		}
	}
	return ""
}

// Advise asks for huge pages in the region until the matching Withdraw.
func (r *Region) Advise() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.advised++; r.advised == 1 {
		r.madvise(unix.MADV_HUGEPAGE)
	}
}

// Withdraw ends one Advise; the last one ends the advice. Huge pages the
// region already has stay until the runtime returns their memory.
func (r *Region) Withdraw() {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.advised--; r.advised == 0 {
		// In "madvise" mode, no advice and MADV_NOHUGEPAGE are alike.
		r.madvise(unix.MADV_NOHUGEPAGE)
	}
}

// Advised says whether the region asks for huge pages now.
func (r *Region) Advised() bool {
	if r == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.advised > 0
}

// madvise takes the region by address: a slice over memory the collector
// has freed would be a pointer into a free span. It is best effort; an
// error leaves the heap as the runtime made it.
func (r *Region) madvise(advice int) {
	start := (r.base + uintptr(unix.Getpagesize()) - 1) &^ (uintptr(unix.Getpagesize()) - 1)
	_, _, _ = unix.Syscall(unix.SYS_MADVISE, start, r.base+r.size-start, uintptr(advice))
}
