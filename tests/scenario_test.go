package tests

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
	"github.com/egressd/egressd/internal/redistest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/sdk"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
	"github.com/egressd/egressd/pkg/verdict"
)

// dependency is the service both hosts call, in a network namespace of
// its own. /work has a capacity (requests served at once; the rest wait in
// order)
// and a lognormal service time around 10 ms; /quota has its own quota of
// quotaPerSecond requests per clock second, published in RateLimit-Remaining
// and enforced with 429 and Retry-After. It records what it saw: requests
// in its /work handler at once, per host, and /quota requests per second.
type dependency struct {
	workPort, quotaPort int

	// workers is the capacity: a request holds one while it is served.
	// Blocked channel sends are served in order, so the queue is FIFO,
	// as a real server's accept queue and worker pool are.
	workers  chan struct{}
	mu       sync.Mutex
	inWork   map[string]int // by client address: requests in the handler
	peakWork map[string]int

	quotaMu     sync.Mutex
	perSecond   map[int64]int // unix second → /quota requests
	quotaTotal  int
	quotaFirst  time.Time
	tooMany     int
	quotaByHost map[string]int
}

const quotaPerSecond = 100

func newDependency(t *testing.T, ns *privtest.NetNS, capacity int) *dependency {
	t.Helper()
	d := &dependency{workers: make(chan struct{}, capacity), inWork: map[string]int{}, peakWork: map[string]int{}, perSecond: map[int64]int{}, quotaByHost: map[string]int{}}
	serve := func(h http.HandlerFunc) int {
		var ln net.Listener
		if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:0"); return err }); err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		return ln.Addr().(*net.TCPAddr).Port
	}
	d.workPort = serve(d.work)
	d.quotaPort = serve(d.quota)
	return d
}

func clientHost(r *http.Request) string {
	h, _, _ := net.SplitHostPort(r.RemoteAddr)
	return h
}

func (d *dependency) work(w http.ResponseWriter, r *http.Request) {
	host := clientHost(r)
	d.mu.Lock()
	d.inWork[host]++
	d.peakWork[host] = max(d.peakWork[host], d.inWork[host])
	d.mu.Unlock()
	d.workers <- struct{}{}
	time.Sleep(time.Duration(float64(10*time.Millisecond) * math.Exp(0.5*rand.NormFloat64())))
	<-d.workers
	d.mu.Lock()
	d.inWork[host]--
	d.mu.Unlock()
	w.Write([]byte("done\n"))
}

// takeWorkers lowers the capacity by n: a worker takes n places in the
// queue like any request and keeps them.
func (d *dependency) takeWorkers(t *testing.T, n int) {
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		for range n {
			d.workers <- struct{}{}
		}
	}()
}

// workPeaks returns the most /work requests each host had in the handler
// at once since the last call, and starts afresh.
func (d *dependency) workPeaks() map[string]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := d.peakWork
	d.peakWork = map[string]int{}
	for h, n := range d.inWork {
		d.peakWork[h] = n
	}
	return out
}

func (d *dependency) quota(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	d.quotaMu.Lock()
	if d.quotaFirst.IsZero() {
		d.quotaFirst = now
	}
	d.quotaTotal++
	d.quotaByHost[clientHost(r)]++
	sec := now.Unix()
	d.perSecond[sec]++
	n := d.perSecond[sec]
	if n > quotaPerSecond {
		d.tooMany++
	}
	d.quotaMu.Unlock()
	w.Header().Set("RateLimit-Remaining", strconv.Itoa(max(0, quotaPerSecond-n)))
	if n > quotaPerSecond {
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	w.Write([]byte("ok\n"))
}

// sdkService is a Go service using the SDK, run as a helper process in a
// host's namespace and cgroup: for each URL, N workers call it through an
// sdkhttp stack (retries, the dependency's published quota) with a new
// connection per request, a policy, retry budget and breaker of its own,
// and the host's egressd as the attributor of EPERMs. Each "stats" line on
// its input prints one line per URL:
//
//	URL ok N throttled N other N refused N budget TOKENS breaker STATE
//
// throttled counts calls that gave up after attempts that were all
// refusals (self-imposed or 429s), other every other failed call, and
// refused the attempts the SDK judged self-imposed refusals. At the end of
// its input it stops, prints the same, and exits.
func runSDKService(args []string) error {
	if len(args) < 3 || len(args)%2 != 1 {
		return fmt.Errorf("sdkservice: want SOCKET then URL N pairs, got %q", args)
	}
	attributor := sdk.DaemonAttributor(&control.Client{Socket: args[0]})
	type counts struct {
		mu                         sync.Mutex
		ok, throttled, other, refd int
		budget                     *sdk.RetryBudget
		breaker                    *sdk.Breaker
		url                        string
	}
	var all []*counts
	print := func() {
		for _, c := range all {
			c.mu.Lock()
			fmt.Printf("%s ok %d throttled %d other %d refused %d budget %g breaker %v\n",
				c.url, c.ok, c.throttled, c.other, c.refd, c.budget.Tokens(), c.breaker.State(time.Now()))
			c.mu.Unlock()
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := 1; i < len(args); i += 2 {
		n, err := strconv.Atoi(args[i+1])
		if err != nil {
			return err
		}
		p := sdkhttp.Defaults()
		p.Classifier = p.Classifier.WithAttributor(attributor)
		p.MaxAttempts = 20
		p.Backoff = sdk.Backoff{Throttled: sdk.Curve{Initial: 10 * time.Millisecond, Multiplier: 1.5}, Transient: sdk.Curve{Initial: 20 * time.Millisecond, Multiplier: 2}, MaxDelay: 200 * time.Millisecond, Jitter: 0.5}
		p.Deadline = 10 * time.Second
		c := &counts{url: args[i], budget: sdk.NewRetryBudget(0.1, 10), breaker: sdk.NewBreaker(sdk.BreakerOptions{})}
		p.Budget, p.Breaker = c.budget, c.breaker
		rt, err := sdkhttp.NewStack(&http.Transport{DisableKeepAlives: true}).Retry(p).Quota(sdkhttp.QuotaOptions{}).Build()
		if err != nil {
			return err
		}
		client := &http.Client{Transport: rt}
		all = append(all, c)
		for range n {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					var res sdkhttp.Result
					req, _ := http.NewRequestWithContext(sdkhttp.WithResult(context.Background(), &res), http.MethodGet, c.url, nil)
					resp, err := client.Do(req)
					good := err == nil && resp.StatusCode == http.StatusOK
					if resp != nil {
						resp.Body.Close()
					}
					refused, throttled := 0, 0
					for _, a := range res.Attempts {
						if a.Kind() == verdict.Throttled {
							throttled++
							if a.SelfImposed() {
								refused++
							}
						}
					}
					c.mu.Lock()
					c.refd += refused
					switch {
					case good:
						c.ok++
					case throttled == len(res.Attempts):
						c.throttled++
					default:
						c.other++
					}
					c.mu.Unlock()
					if !good {
						time.Sleep(10 * time.Millisecond) // not a hot loop
					}
				}
			})
		}
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() == "stats" {
			print()
		}
	}
	close(stop)
	wg.Wait()
	print()
	return nil
}

// serviceStats is one URL's line of sdkService's counts.
type serviceStats struct {
	url                           string
	ok, throttled, other, refused int
	budget                        float64
	breaker                       string
}

var serviceLine = regexp.MustCompile(`^(\S+) ok (\d+) throttled (\d+) other (\d+) refused (\d+) budget (\S+) breaker (\S+)$`)

func parseServiceLine(t *testing.T, l string) serviceStats {
	t.Helper()
	m := serviceLine.FindStringSubmatch(l)
	if m == nil {
		t.Fatalf("sdk service said %q", l)
	}
	n := func(i int) int { v, _ := strconv.Atoi(m[i]); return v }
	b, _ := strconv.ParseFloat(m[6], 64)
	return serviceStats{url: m[1], ok: n(2), throttled: n(3), other: n(4), refused: n(5), budget: b, breaker: m[7]}
}

// stats asks a service for its counts, one per URL.
func serviceCounts(t *testing.T, c *privtest.Child) []serviceStats {
	t.Helper()
	first := c.Call(t, "stats")
	return []serviceStats{parseServiceLine(t, first), parseServiceLine(t, c.Line(t))}
}

// httpScript is a client that is not Go: GET PATH on a new connection,
// again and again, until its input closes; then it prints its counts. A
// refused connect() is an OSError with errno EPERM.
const httpScript = `
import errno, http.client, sys, threading, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
ok = refused = failed = 0
print("started", flush=True)
while not stop.is_set():
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        if r.status == 200:
            ok += 1
        else:
            failed += 1
    except OSError as e:
        if e.errno == errno.EPERM:
            refused += 1
            time.sleep(0.01)
        else:
            failed += 1
    finally:
        c.close()
print("ok %d refused %d failed %d" % (ok, refused, failed), flush=True)
`

// scenarioHost is one host of the scenario: a network namespace linked to
// the dependency's, an egressd attached to its own cgroup, and two child
// cgroups, one for the Go service and one for the Python client.
type scenarioHost struct {
	*sharingHost
	svc, py string
}

func (h *scenarioHost) url(port int, path string) string {
	return fmt.Sprintf("http://%s:%d%s", h.dest, port, path)
}

// TestScenarioTwoHosts walks the whole system through what an operator
// meets, judged by what the dependency observed: two hosts, each with an
// egressd, a Go service on the SDK and a Python client, calling one
// dependency; an adaptive limit on /work finds its capacity and follows it
// down when it halves; a per-second budget on /quota, shared through Redis,
// holds across both hosts; the SDK sees kernel refusals as self-imposed
// (its retry budget untouched, its breaker closed) while Python gets EPERM;
// one daemon is killed with -9 and restarted, and a bad policy reload is
// refused with the old policy in force.
func TestScenarioTwoHosts(t *testing.T) {
	privtest.RequireRoot(t)
	const (
		capacity = 16
		budget   = 40 // /quota per second, both hosts together
	)
	rds := redistest.Start(t)
	depNS := privtest.NewNetNS(t)
	dep := newDependency(t, depNS, capacity)
	policy := fmt.Sprintf(`  - name: work
    destination: DEST
    port: %d
    adaptive: {minimum: 2, maximum: 64, initial: 8, probeEvery: 100, samples: request}
  - name: quota
    destination: DEST
    port: %d
    perSecond: {permits: %d}
    shared: {redis: %q, key: "scenario:quota"}
`, dep.workPort, dep.quotaPort, budget, rds.URL())
	started := time.Now()
	var hosts []*scenarioHost
	for i := range 2 {
		sh := newSharingHost(t, 21+i, depNS, policy)
		h := &scenarioHost{sharingHost: sh, svc: privtest.SubCgroup(t, sh.cg, "svc"), py: privtest.SubCgroup(t, sh.cg, "py")}
		hosts = append(hosts, h)
	}
	a, b := hosts[0], hosts[1]

	// Load: host A's service pushes /work well above its capacity; host B's
	// calls it lightly; both services and both Python clients call /quota.
	const run = 24 * time.Second
	loadStart := time.Now()
	svcA := a.ns.Spawn(t, a.svc, "sdkservice", a.socket, a.url(dep.workPort, "/work"), "96", a.url(dep.quotaPort, "/quota"), "4")
	svcB := b.ns.Spawn(t, b.svc, "sdkservice", b.socket, b.url(dep.workPort, "/work"), "2", b.url(dep.quotaPort, "/quota"), "4")
	var pys []*pyProc
	for _, h := range hosts {
		p := startPythonIn(t, h.ns, h.py, httpScript, h.dest, strconv.Itoa(dep.quotaPort), "/quota")
		if l := p.line(t); l != "started" {
			t.Fatalf("python client: %q", l)
		}
		pys = append(pys, p)
	}

	// Host A's adaptive rule finds the capacity; then the capacity halves.
	// The settled limit is read outside drain probes, every 50 ms for
	// 6 s: the loop's limit oscillates around its equilibrium (about 1.8
	// times the capacity here), and a shorter read lets a loaded
	// machine's noise move the median.
	settledOver := func(d time.Duration) []int {
		var out []int
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
			out = append(out, int(a.rule(t, "work").SettledLimit))
		}
		slices.Sort(out)
		return out
	}
	settledOver(6 * time.Second)
	before := settledOver(6 * time.Second)
	dep.takeWorkers(t, capacity/2)
	settledOver(4 * time.Second)
	after := settledOver(6 * time.Second)
	peaks := dep.workPeaks()

	// Host B's daemon dies mid-run (kill -9) and comes back: the kernel
	// keeps enforcing while it is gone, and the new one carries on.
	b.d.kill(t)
	time.Sleep(500 * time.Millisecond)
	b.d = b.start(t)
	if !b.status(t).Adopted {
		t.Error("the restarted daemon did not adopt the pinned datapath")
	}
	time.Sleep(2 * time.Second)
	bAfterRestart := serviceCounts(t, svcB)

	// A bad policy reload on host A changes nothing.
	a.writePolicy(t, "rules:\n  - name: work\n    destination: [not, an, address]\n")
	if r := a.cli(t, "policy", "reload"); r.code == 0 || !strings.Contains(r.stderr, "destination") {
		t.Errorf("a bad policy reload: exit %d, %q; want refused, naming the problem", r.code, r.stderr)
	}
	refusedBefore := a.limit(t, "work").Refused
	clocktest.Eventually(t, "the work rule to refuse after the refused reload", func() bool { return a.limit(t, "work").Refused > refusedBefore })
	if l := a.limit(t, "work"); l.Pending != "" {
		t.Errorf("after the refused reload the work rule has a change pending: %q", l.Pending)
	}
	if st := a.status(t); st.LastReload.OK || !strings.Contains(st.LastReload.Error, "destination") {
		t.Errorf("status after the bad reload: %+v", st.LastReload)
	}

	// The rest of the run, then every client stops and reports.
	time.Sleep(time.Until(loadStart.Add(run)))
	final := map[*privtest.Child][]serviceStats{}
	for _, svc := range []*privtest.Child{svcA, svcB} {
		svc.CloseInput()
		final[svc] = []serviceStats{parseServiceLine(t, svc.Line(t)), parseServiceLine(t, svc.Line(t))}
		svc.Wait(t)
	}
	loadEnd := time.Now()
	for i, p := range pys {
		p.stdin.Close()
		l := p.line(t)
		var ok, refused, failed int
		if _, err := fmt.Sscanf(l, "ok %d refused %d failed %d", &ok, &refused, &failed); err != nil {
			t.Fatalf("python client: %q", l)
		}
		t.Logf("host %c python client on /quota: %s", 'A'+i, l)
		if ok == 0 || refused == 0 || failed != 0 {
			t.Errorf("host %c python client: %s; want calls through, EPERM refusals, no other failure", 'A'+i, l)
		}
	}

	// The adaptive limit, by what the dependency saw.
	median := func(xs []int) int { return xs[len(xs)/2] }
	pushed := maxPushed(a.d.log.String(), "work")
	t.Logf("host A /work settled limit: capacity %d → %v (median %d); capacity %d → %v (median %d); most pushed %d; dependency's /work peaks per host %v",
		capacity, before, median(before), capacity/2, after, median(after), pushed, peaks)
	if m := median(before); m < capacity || float64(m) > 2.2*capacity {
		t.Errorf("settled limit %d with capacity %d; want inside [%d, %.1f]", m, capacity, capacity, 2.2*capacity)
	}
	if m := median(after); float64(m) > 2.2*capacity/2 || m >= median(before) {
		t.Errorf("after the capacity halved the settled limit is %d (was %d); want it to follow down to ≤ %.1f", m, median(before), 2.2*capacity/2)
	}
	if peaks[a.client] > pushed {
		t.Errorf("the dependency held %d of host A's /work requests at once; A's limit never went above %d", peaks[a.client], pushed)
	}

	// The shared budget, by what the dependency saw.
	dep.quotaMu.Lock()
	total, byHost, tooMany := dep.quotaTotal, maps.Clone(dep.quotaByHost), dep.tooMany
	dep.quotaMu.Unlock()
	bound := budget + budget*loadEnd.Sub(started).Seconds()
	t.Logf("/quota: the dependency served %d requests in %v (shared budget at most %.0f; by host %v), answered %d with 429",
		total, loadEnd.Sub(started).Round(time.Millisecond), bound, byHost, tooMany)
	if float64(total) > bound || tooMany != 0 {
		t.Errorf("/quota: %d requests against a shared budget of at most %.0f, %d over the dependency's own quota", total, bound, tooMany)
	}
	if byHost[a.client] == 0 || byHost[b.client] == 0 || float64(total) < 0.5*budget*run.Seconds() {
		t.Errorf("/quota: %d requests (%v); want both hosts served and at least half the budget used", total, byHost)
	}

	// The SDK's view: refusals are self-imposed, cost no budget, open no
	// breaker.
	for svc, name := range map[*privtest.Child]string{svcA: "A", svcB: "B"} {
		for _, st := range final[svc] {
			t.Logf("host %s sdk service: %+v", name, st)
			if st.budget != 10 || st.breaker != "closed" {
				t.Errorf("host %s, %s: retry budget %g of 10, breaker %s; want untouched and closed", name, st.url, st.budget, st.breaker)
			}
		}
	}
	for _, st := range final[svcA] {
		if st.refused == 0 || st.other != 0 {
			t.Errorf("host A, %s: %d self-imposed refusals, %d calls failed otherwise; want refusals and no other failure", st.url, st.refused, st.other)
		}
	}
	// Host B's service cannot ask a dead daemon about its EPERMs, which
	// then stay errors; once the daemon is back, no more.
	for i, st := range final[svcB] {
		if st.other != bAfterRestart[i].other {
			t.Errorf("host B, %s: %d calls failed otherwise after its daemon was back (%d before)", st.url, st.other-bAfterRestart[i].other, bAfterRestart[i].other)
		}
	}
}

// maxPushed is the highest limit an adaptive rule was given, from a
// daemon's debug log: polling could miss a peak between two polls.
func maxPushed(log, rule string) int {
	most := 0
	for _, m := range regexp.MustCompile(`msg="adaptive limit" rule=`+regexp.QuoteMeta(rule)+` limit=(\d+)`).FindAllStringSubmatch(log, -1) {
		n, _ := strconv.Atoi(m[1])
		most = max(most, n)
	}
	return most
}

func (h *sharingHost) status(t *testing.T) control.Status {
	t.Helper()
	var s control.Status
	h.json(t, &s, "status")
	return s
}
