// Command sdkclient calls a rate-limited HTTP dependency through the SDK's
// transport stack - retries outermost, the dependency's published quota and
// a per-second limiter inside them - and prints each request's attempt log
// and why the executor stopped.
//
// Without -url it starts a dependency of its own on loopback, which allows
// -allow requests per second, says how many are left in RateLimit headers,
// and answers 429 past that. See README.md for a run under egressd, where
// the kernel's refusals are attributed to its rules.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/egressd/egressd/pkg/limit"
	"github.com/egressd/egressd/pkg/sdk/sdkhttp"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "sdkclient:", err)
		os.Exit(1)
	}
}

type config struct {
	url      string
	n        int
	rate     int
	allow    int
	newConns bool
}

func parse(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("sdkclient", flag.ContinueOnError)
	fs.StringVar(&c.url, "url", "", "the dependency to call; empty starts a limited one on loopback")
	fs.IntVar(&c.n, "n", 12, "requests to make, one after another")
	fs.IntVar(&c.rate, "rate", 4, "this client's own limit, requests per second")
	fs.IntVar(&c.allow, "allow", 6, "without -url: requests per second the local dependency allows")
	fs.BoolVar(&c.newConns, "new-conns", false, "a new connection per request, so that a kernel per-second rule sees each one")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.n < 0:
		return c, fmt.Errorf("-n %d must not be negative", c.n)
	case c.rate < 1 || c.rate > limit.MaxRate:
		return c, fmt.Errorf("-rate %d must lie between 1 and %d", c.rate, limit.MaxRate)
	case c.allow < 1:
		return c, fmt.Errorf("-allow %d must be at least 1", c.allow)
	}
	return c, nil
}

// run is the program: main only adds the exit.
func run(ctx context.Context, args []string, out io.Writer) error {
	cfg, err := parse(args)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	url := cfg.url
	if url == "" {
		dep, err := startDependency(cfg.allow)
		if err != nil {
			return fmt.Errorf("start dependency: %w", err)
		}
		defer dep.Close()
		url = dep.URL
		fmt.Fprintf(out, "dependency at %s allows %d requests per second\n", url, cfg.allow)
	}

	client, err := newClient(cfg)
	if err != nil {
		return err
	}
	defer client.CloseIdleConnections()
	for i := 1; i <= cfg.n; i++ {
		if err := call(ctx, client, url, i, out); err != nil {
			return err
		}
	}
	return nil
}

// newClient builds the stack: retries by sdkhttp.Defaults (sdk.HTTPDefaults
// with egressd's attributor), then the published quota, then this client's
// own per-second limit, each of them once per attempt.
func newClient(cfg config) (*http.Client, error) {
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.DisableKeepAlives = cfg.newConns
	rt, err := sdkhttp.NewStack(base).
		Retry(sdkhttp.Defaults()).
		Quota(sdkhttp.QuotaOptions{}).
		Limit(limit.PerSecond(cfg.rate)).
		Build()
	if err != nil {
		return nil, err
	}
	return &http.Client{Transport: rt}, nil
}

// call makes request i and prints what became of it. A failed request is
// part of the output, not an error of the program's.
func call(ctx context.Context, client *http.Client, url string, i int, out io.Writer) error {
	var res sdkhttp.Result
	req, err := http.NewRequestWithContext(sdkhttp.WithResult(ctx, &res), http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	outcome := ""
	resp, err := client.Do(req)
	if err != nil {
		outcome = err.Error()
	} else {
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		outcome = resp.Status
		if err != nil {
			outcome += ", reading the body: " + err.Error()
		}
	}
	attempts := strconv.Itoa(len(res.Attempts)) + " attempt"
	if len(res.Attempts) != 1 {
		attempts += "s"
	}
	fmt.Fprintf(out, "request %d: %s after %s (%v)\n", i, outcome, attempts, res.Stop)
	for j, a := range res.Attempts {
		fmt.Fprintf(out, "    %d: %v\n", j+1, a)
	}
	return nil
}

// dependency is a local HTTP server that allows so many requests in each
// one-second window and publishes the allowance.
type dependency struct {
	URL string
	srv *http.Server

	allow int
	mu    sync.Mutex
	start time.Time // of the current window
	used  int
}

func startDependency(allow int) (*dependency, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	d := &dependency{URL: "http://" + ln.Addr().String() + "/", allow: allow}
	d.srv = &http.Server{Handler: d, ReadHeaderTimeout: 5 * time.Second}
	go d.srv.Serve(ln)
	return d, nil
}

func (d *dependency) Close() error { return d.srv.Close() }

func (d *dependency) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	now := time.Now()
	if now.Sub(d.start) >= time.Second {
		d.start, d.used = now, 0
	}
	admitted := d.used < d.allow
	if admitted {
		d.used++
	}
	remaining := d.allow - d.used
	reset := strconv.Itoa(int(math.Ceil(d.start.Add(time.Second).Sub(now).Seconds())))
	d.mu.Unlock()

	h := w.Header()
	h.Set("RateLimit-Limit", strconv.Itoa(d.allow))
	h.Set("RateLimit-Remaining", strconv.Itoa(remaining))
	h.Set("RateLimit-Reset", reset)
	if !admitted {
		h.Set("Retry-After", reset)
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}
	io.WriteString(w, "ok\n")
}
