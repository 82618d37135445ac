package shared

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/redis/go-redis/v9"
)

// helperEnv, set to 1, makes the test binary a helper process of
// TestProcessesShareBudget instead of running tests.
const helperEnv = "EGRESSD_SHARED_HELPER"

const (
	helperProcs   = 3
	helperWorkers = 16
	helperRun     = 600 * time.Millisecond
	// How long a concurrency lease is held: long beside a Redis round
	// trip on a loaded machine, so that the budget is seen reached from
	// the clients' side (1 ms saw at most 3 of 4 held under -race with the
	// machine's load at 5.5).
	leaseHold = 20 * time.Millisecond
)

// processShapes are the budgets the helpers share, by shape name.
var processShapes = map[string]Options{
	"fixed":       {FixedWindow: &FixedWindowOptions{Permits: 20, Window: 50 * time.Millisecond}},
	"sliding":     {SlidingWindow: &SlidingWindowOptions{Permits: 20, Window: 100 * time.Millisecond, Segments: 5}},
	"bucket":      {TokenBucket: &TokenBucketOptions{TokenLimit: bucketLimit, TokensPerPeriod: bucketPer, ReplenishmentPeriod: bucketPeriod}},
	"concurrency": {Concurrency: &ConcurrencyOptions{Permits: 4, LeaseDuration: 3 * time.Second}},
}

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		os.Exit(sharedHelper(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// sharedHelper is a helper process: args are the redis address, the key,
// the shape, the run's duration and the number of goroutines. It connects,
// prints "ready", waits for a line on in, then runs the goroutines against
// the limiter for the duration and prints, in wall-clock nanoseconds read
// through the monotonic clock:
//
//	start <wall>               when the goroutines began
//	a <id> <t0> <t1> <t2>      one admission: the server's window or segment
//	                           id, before Acquire, after it returned, and
//	                           before Release (t1 for rate shapes)
//	done <attempts> <refusals>
func sharedHelper(args []string, in io.Reader, out, errOut io.Writer) int {
	fail := func(format string, a ...any) int {
		fmt.Fprintf(errOut, "helper: "+format+"\n", a...)
		return 2
	}
	if len(args) != 5 {
		return fail("want args: addr key shape duration workers, got %q", args)
	}
	addr, key, shape := args[0], args[1], args[2]
	d, err := time.ParseDuration(args[3])
	if err != nil {
		return fail("duration: %v", err)
	}
	workers, err := strconv.Atoi(args[4])
	if err != nil {
		return fail("workers: %v", err)
	}
	opts, ok := processShapes[shape]
	if !ok {
		return fail("unknown shape %q", shape)
	}
	opts.Key = key
	// A safety net: never outlive the parent by much.
	time.AfterFunc(d+20*time.Second, func() {
		fmt.Fprintln(errOut, "helper: overran, exiting")
		os.Exit(3)
	})
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second,
		ReadTimeout: 2 * time.Second, PoolSize: 2 * workers})
	defer c.Close()
	l, err := New(c, opts)
	if err != nil {
		return fail("New: %v", err)
	}
	if err := c.Ping(context.Background()).Err(); err != nil {
		return fail("ping %s: %v", addr, err)
	}
	w := bufio.NewWriter(out)
	fmt.Fprintln(w, "ready")
	if err := w.Flush(); err != nil {
		return fail("write: %v", err)
	}
	if _, err := bufio.NewReader(in).ReadString('\n'); err != nil {
		return fail("waiting for go: %v", err)
	}

	base := time.Now()
	wall := func(t time.Time) int64 { return base.UnixNano() + int64(t.Sub(base)) } // monotonic → wall
	end := base.Add(d)
	type rec struct {
		id         int64
		t0, t1, t2 time.Time
	}
	recs := make([][]rec, workers)
	refusedIn := make([]map[int64]bool, workers) // the windows or segments that refused
	var attempts, refusals atomic.Int64
	var errMu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	for i := range workers {
		refusedIn[i] = map[int64]bool{}
		wg.Go(func() {
			for time.Now().Before(end) {
				t0 := time.Now()
				lease, res, err := l.acquire(context.Background())
				t1 := time.Now()
				attempts.Add(1)
				if err != nil {
					if sdk.IsRateLimited(err) {
						refusals.Add(1)
						refusedIn[i][res.id] = true
						continue
					}
					errMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
					return
				}
				t2 := t1
				if l.conc {
					// Real Redis, across processes, on the real clock: the work a lease guards.
					time.Sleep(leaseHold)
					t2 = time.Now()
				}
				lease.Release()
				recs[i] = append(recs[i], rec{res.id, t0, t1, t2})
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return fail("acquire: %v", firstErr)
	}
	fmt.Fprintf(w, "start %d\n", wall(base))
	for _, rs := range recs {
		for _, r := range rs {
			fmt.Fprintf(w, "a %d %d %d %d\n", r.id, wall(r.t0), wall(r.t1), wall(r.t2))
		}
	}
	for _, ids := range refusedIn {
		for id := range ids {
			fmt.Fprintf(w, "r %d\n", id)
		}
	}
	fmt.Fprintf(w, "done %d %d\n", attempts.Load(), refusals.Load())
	if err := w.Flush(); err != nil {
		return fail("write: %v", err)
	}
	return 0
}

// admission is one admitted call, as a helper reported it.
type admission struct {
	proc       int
	id         int64 // the server's window or segment id
	t0, t1, t2 int64 // wall ns: before Acquire, after it, before Release
}

// helperReport is what one helper process reported.
type helperReport struct {
	start              int64
	admitted           []admission
	attempts, refusals int64
	refused            map[int64]bool // windows or segments that refused a call
}

// runHelpers runs helperProcs helper processes of shape against key on s,
// starts them together once all are connected, and returns their reports.
func runHelpers(t *testing.T, s *redistest.Server, key, shape string) []helperReport {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	t.Cleanup(cancel)
	type proc struct {
		cmd    *exec.Cmd
		stdin  io.WriteCloser
		stdout *bufio.Reader
		stderr bytes.Buffer
	}
	procs := make([]*proc, helperProcs)
	for i := range procs {
		p := &proc{}
		p.cmd = exec.CommandContext(ctx, exe, s.Addr(), key, shape, helperRun.String(), strconv.Itoa(helperWorkers))
		p.cmd.Env = append(os.Environ(), helperEnv+"=1")
		p.cmd.Stderr = &p.stderr
		if p.stdin, err = p.cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		stdout, err := p.cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		p.stdout = bufio.NewReader(stdout)
		if err := p.cmd.Start(); err != nil {
			t.Fatalf("start helper %d: %v", i, err)
		}
		t.Cleanup(func() {
			_ = p.cmd.Process.Kill() // harmless once it has exited
			_ = p.cmd.Wait()         // reaps it if the test failed before doing so
		})
		procs[i] = p
	}
	for i, p := range procs {
		if line, err := p.stdout.ReadString('\n'); line != "ready\n" {
			t.Fatalf("helper %d said %q (%v); stderr: %s", i, line, err, p.stderr.String())
		}
	}
	for i, p := range procs {
		if _, err := io.WriteString(p.stdin, "go\n"); err != nil {
			t.Fatalf("helper %d: %v", i, err)
		}
	}
	reports := make([]helperReport, helperProcs)
	admittedProcs := 0
	for i, p := range procs {
		r := &reports[i]
		done := false
		for {
			line, err := p.stdout.ReadString('\n')
			if err == io.EOF && line == "" {
				break
			}
			if err != nil {
				t.Fatalf("helper %d: read: %v; stderr: %s", i, err, p.stderr.String())
			}
			f := strings.Fields(line)
			n := make([]int64, len(f))
			for j := 1; j < len(f); j++ {
				if n[j], err = strconv.ParseInt(f[j], 10, 64); err != nil {
					t.Fatalf("helper %d: bad line %q", i, line)
				}
			}
			switch {
			case len(f) == 2 && f[0] == "start":
				r.start = n[1]
			case len(f) == 5 && f[0] == "a":
				r.admitted = append(r.admitted, admission{proc: i, id: n[1], t0: n[2], t1: n[3], t2: n[4]})
			case len(f) == 2 && f[0] == "r":
				if r.refused == nil {
					r.refused = map[int64]bool{}
				}
				r.refused[n[1]] = true
			case len(f) == 3 && f[0] == "done":
				r.attempts, r.refusals, done = n[1], n[2], true
			default:
				t.Fatalf("helper %d: bad line %q", i, line)
			}
		}
		if err := p.cmd.Wait(); err != nil || !done || r.start == 0 {
			t.Fatalf("helper %d: exit %v, done %v; stderr: %s", i, err, done, p.stderr.String())
		}
		if len(r.admitted) > 0 {
			admittedProcs++
		}
		if int64(len(r.admitted))+r.refusals != r.attempts {
			t.Errorf("helper %d: %d admitted + %d refused != %d attempts", i, len(r.admitted), r.refusals, r.attempts)
		}
		t.Logf("helper %d: %d attempts, %d admitted, %d refused", i, r.attempts, len(r.admitted), r.refusals)
	}
	// The limiters promise no fairness: a loaded machine may leave one
	// process refused every time. Two are enough to share the budget.
	if admittedProcs < 2 {
		t.Errorf("%d of %d processes admitted: the budget was not shared", admittedProcs, helperProcs)
	}
	return reports
}

// TestProcessesShareBudget runs helperProcs processes of helperWorkers
// goroutines each against one key of each shape, and checks the merged
// admissions never exceed the budget: exact counts per fixed window and per
// sliding window, tokens spent at most the bucket plus its refill, and at
// most Permits concurrency leases overlapping at any instant.
func TestProcessesShareBudget(t *testing.T) {
	s := startRedis(t)
	for _, shape := range []string{"fixed", "sliding", "bucket", "concurrency"} {
		t.Run(shape, func(t *testing.T) {
			key := "process/" + shape
			opts := processShapes[shape]
			// The bucket is emptied before the helpers start and after
			// they end (see checkRefill); times are the wall clock's, as
			// the helpers'.
			var drain func() int
			if shape == "bucket" {
				o := opts
				o.Key = key
				l := newLimiter(t, s, o)
				drain = func() int { return drainBucket(t, l) }
			}
			var t0, t1 time.Time
			before := 0
			if drain != nil {
				t0 = time.Now()
				before = drain()
				t1 = time.Now()
			}
			reports := runHelpers(t, s, key, shape)
			var all []admission
			refused := map[int64]bool{}
			for _, r := range reports {
				all = append(all, r.admitted...)
				for id := range r.refused {
					refused[id] = true
				}
			}
			switch shape {
			case "fixed":
				checkWindows(t, all, refused, opts.FixedWindow.Permits, 1, opts.FixedWindow.Window)
			case "sliding":
				o := opts.SlidingWindow
				checkWindows(t, all, refused, o.Permits, o.Segments, o.Window/time.Duration(o.Segments))
			case "bucket":
				t2 := time.Now()
				after := len(all) + drain()
				checkRefill(t, before+after, after, t0, t1, t2, time.Now())
			case "concurrency":
				checkOverlap(t, all, opts.Concurrency.Permits)
			}
		})
	}
}

// checkWindows checks windows of n consecutive segments (n = 1: fixed
// windows), by the server's ids: none admitted more than permits, and most
// of those strictly between the first and the last segment seen admitted
// exactly permits (a busy machine may stall every client for a segment,
// so not all are required to).
func checkWindows(t *testing.T, all []admission, refused map[int64]bool, permits, n int, seg time.Duration) {
	t.Helper()
	counts := map[int64]int{}
	procs := map[int64]map[int]bool{}
	lo, hi := int64(1<<62), int64(-1<<62)
	for _, a := range all {
		counts[a.id]++
		if procs[a.id] == nil {
			procs[a.id] = map[int]bool{}
		}
		procs[a.id][a.proc] = true
		lo, hi = min(lo, a.id), max(hi, a.id)
	}
	if want := int64(helperRun / seg); hi-lo+1 < want/2 {
		t.Fatalf("only segments %d..%d seen in %v of %v segments", lo, hi, helperRun, seg)
	}
	exact, mixed := 0, 0
	for cur := lo; cur <= hi; cur++ {
		sum, ps := 0, map[int]bool{}
		for id := cur - int64(n) + 1; id <= cur; id++ {
			sum += counts[id]
			for p := range procs[id] {
				ps[p] = true
			}
		}
		// A window that refused a call in its newest segment was full
		// then, and nothing more fits in it until that segment ends: it
		// admitted exactly the permits. (Loaded clients may leave others
		// short.)
		if sum > permits || (refused[cur] && sum != permits) {
			t.Errorf("segments %d..%d admitted %d (refused some: %v), want at most %d, and %d if it refused any", cur-int64(n)+1, cur, sum, refused[cur], permits, permits)
		}
		if refused[cur] && sum == permits {
			exact++
		}
		if len(ps) > 1 {
			mixed++
		}
	}
	if exact == 0 {
		t.Errorf("no window was filled to its %d permits: the processes never met the budget", permits)
	}
	if mixed == 0 {
		t.Errorf("no window admitted calls from more than one process: %v", counts)
	}
	t.Logf("%d admitted in segments %d..%d (%d windows of %d segment(s)): %d windows filled to exactly %d, none over; %d windows shared by processes (of %d)",
		len(all), lo, hi, hi-lo+1, n, exact, permits, mixed, helperProcs)
}

// checkOverlap sweeps the merged lease intervals, [after Acquire returned,
// before Release was called]: inner bounds of the leases' lives in Redis,
// so an instant inside more than permits of them is an over-admission. An
// interval ending where another starts does not overlap it.
func checkOverlap(t *testing.T, all []admission, permits int) {
	t.Helper()
	type event struct {
		at    int64
		delta int
		proc  int
	}
	events := make([]event, 0, 2*len(all))
	for _, a := range all {
		if a.t2 < a.t1 {
			t.Fatalf("lease released at %d before it was acquired at %d", a.t2, a.t1)
		}
		events = append(events, event{a.t1, +1, a.proc}, event{a.t2, -1, a.proc})
	}
	slices.SortFunc(events, func(a, b event) int {
		if a.at != b.at {
			return cmp.Compare(a.at, b.at)
		}
		return cmp.Compare(a.delta, b.delta) // ends first
	})
	held, most, atMost, mixedAtMost := 0, 0, 0, 0
	var byProc [helperProcs]int
	for _, e := range events {
		held += e.delta
		byProc[e.proc] += e.delta
		if e.delta < 0 {
			continue
		}
		if held > most {
			most, atMost, mixedAtMost = held, 0, 0
		}
		if held == most {
			atMost++
			ps := 0
			for _, n := range byProc {
				if n > 0 {
					ps++
				}
			}
			if ps > 1 {
				mixedAtMost++
			}
		}
	}
	if most > permits {
		t.Errorf("%d leases held at once, more than %d", most, permits)
	}
	if most < permits {
		t.Errorf("at most %d leases held at once, want the budget, %d, reached", most, permits)
	}
	if mixedAtMost == 0 {
		t.Errorf("the most leases held at once never came from more than one process")
	}
	t.Logf("%d leases of %v: at most %d held at once (budget %d), reached %d times, %d of them with holders in several processes",
		len(all), leaseHold, most, permits, atMost, mixedAtMost)
}
