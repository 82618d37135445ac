package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// Run: the daemon's start, its loops and servers, its wait for signals and
// requests, and the one path that stops all it started.

// cleanups are what Run undoes as it stops, last started first.
type cleanups []func() error

func (c *cleanups) push(f func() error) { *c = append(*c, f) }

func (c cleanups) run() error {
	var errs []error
	for i := len(c) - 1; i >= 0; i-- {
		errs = append(errs, c[i]())
	}
	return errors.Join(errs...)
}

// Run runs the daemon until ctx ends (SIGTERM and SIGINT end it, in egressd
// run) or an uninstall request comes; SIGHUP reloads the policy. Whatever
// it started it stops on one path, the goroutines it started joined, and
// the errors of stopping are joined to its result. The datapath stays
// pinned and enforcing unless it was asked to uninstall (then the result
// is ErrUninstalled) or to detach on exit.
func (d *Daemon) Run(ctx context.Context) (err error) {
	// SIGHUP is caught from the first moment: its default is to end the
	// process, and one that comes while the daemon starts, or just after
	// it said it is ready (systemctl start, then reload), is a reload.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var stack cleanups
	defer func() { err = errors.Join(err, stack.run()) }()
	began := time.Now()
	d.api.started = began
	if err := d.table.restoreOverrides(); err != nil {
		return err
	}
	if err := d.table.restoreKube(); err != nil {
		return err
	}
	if err := d.newKube(); err != nil {
		return err
	}
	d.names.restore()
	// The socket first: a second daemon started by mistake stops here,
	// before it touches the datapath of the first.
	srv, err := controlserver.New(controlserver.Config{Socket: d.cfg.Socket, Group: d.cfg.SocketGroup, Mode: d.cfg.SocketMode, Routes: d.api.routes(), Logger: d.log})
	if err != nil {
		return err
	}
	ln, err := srv.Listen()
	if err != nil {
		return err
	}
	serving := false
	stack.push(func() error {
		if serving {
			return nil // Shutdown closed it
		}
		return ln.Close()
	})
	detach := false
	took, err := d.enforce(ctx, &stack, &detach)
	if err != nil {
		return err
	}
	metricsLn, err := d.listenMetrics()
	if err != nil {
		return err
	}
	serving = true
	d.serve(ctx, &stack, srv, ln, metricsLn)
	uninstall := d.wait(ctx, hup, began, took)
	detach = uninstall || d.cfg.DetachOnExit
	d.log.Info("egressd stopping", "detach", detach)
	if uninstall {
		return ErrUninstalled
	}
	return nil
}

// startTimes is how long the start's phases took, for its log line. With
// a large policy, reading it and installing its rules are most of a start,
// and the datapath opens while it is read: datapathWait is the wait for
// it after the read (a small policy's is the whole open), so that the
// phases add up to the start.
type startTimes struct{ read, datapathWait, install time.Duration }

// enforce reads the policy file, opens the datapath (pushing on stack what
// stops it, as openDatapath does) and installs the policy, and says how
// long each took.
func (d *Daemon) enforce(ctx context.Context, stack *cleanups, detach *bool) (took startTimes, err error) {
	early := d.openEarly()
	t := time.Now()
	pol, text, err := d.file.load(true)
	if errors.Is(err, policy.ErrInvalid) {
		var problem string
		if pol, problem, err = d.file.loadLastGood(err); err == nil {
			d.table.startProblem(problem)
		}
		text = nil // already kept
	}
	if err != nil {
		return took, errors.Join(err, early.undo())
	}
	took.read, t = time.Since(t), time.Now()
	if err := d.openDatapath(pol, early, stack, detach); err != nil {
		return took, err
	}
	took.datapathWait, t = time.Since(t), time.Now()
	if err := d.installAtStart(ctx, pol); err != nil {
		return took, fmt.Errorf("apply policy: %w", err)
	}
	d.file.keep(text)
	took.install = time.Since(t)
	return took, nil
}

// earlyOpen is the datapath opened while a large policy is parsed.
type earlyOpen struct {
	done chan struct{}
	dp   datapath
	err  error
}

// openEarly opens the datapath in the background, with tables of the size
// the policy file's text asks for, when that text says it without being
// parsed (policy.Size: a large policy, which takes most of a second to
// parse). nil when it does not: the datapath is then opened after the
// parse. The size read so is the parse's own unless the file changes
// between the two reads; then the install resizes the tables, as for any
// policy that outgrew them.
func (d *Daemon) openEarly() *earlyOpen {
	// A file Size cannot size is read once, by the parse.
	fi, err := os.Stat(d.cfg.PolicyFile)
	if err != nil || fi.Size() < policy.SizedFrom {
		return nil
	}
	e := &earlyOpen{done: make(chan struct{})}
	go func() {
		defer close(e.done)
		// A file that cannot be read or sized so is opened for after the
		// parse, which reports what is wrong with it.
		data, err := os.ReadFile(d.cfg.PolicyFile)
		if err != nil {
			return
		}
		rules, maxRules, ok := policy.Size(data)
		if !ok {
			return
		}
		e.dp, e.err = d.openWith(&policy.Policy{MaxRules: maxRules}, rules)
	}()
	return e
}

// wait returns the datapath opened early, if it was.
func (e *earlyOpen) wait() (datapath, error) {
	if e == nil {
		return nil, nil
	}
	<-e.done
	return e.dp, e.err
}

// undo puts back what opening the datapath early changed when the policy
// cannot be read: a datapath made just now is taken down, as though the
// start had never begun; one adopted from a previous daemon is left
// pinned and enforcing its rules, with the programs of this build that
// adopting it put in place.
func (e *earlyOpen) undo() error {
	dp, err := e.wait()
	if dp == nil || err != nil {
		return nil
	}
	if dp.Adopted() {
		return dp.Close()
	}
	return dp.Uninstall()
}

// openWith opens the datapath with tables of the size pol wants for its
// rules and the run-time ones (a resize is without a gap, but not free).
func (d *Daemon) openWith(pol *policy.Policy, rules int) (datapath, error) {
	slots, explicit := d.table.openingSize(pol, rules)
	return d.cfg.open(&loader.Config{Cgroup: d.cfg.Cgroup, PinDir: d.cfg.PinDir, MaxRules: slots, GrowOnly: !explicit})
}

// openDatapath opens the datapath, unless early opened it already, and
// pushes on stack what stops it: the shares and their Redis clients, then
// the datapath, closed (pinned and enforcing) or, if *detach is true by
// then, uninstalled.
func (d *Daemon) openDatapath(pol *policy.Policy, early *earlyOpen, stack *cleanups, detach *bool) error {
	dp, err := early.wait()
	if dp == nil && err == nil {
		dp, err = d.openWith(pol, len(pol.Rules))
	}
	if err != nil {
		return fmt.Errorf("datapath: %w", err)
	}
	d.useDatapath(dp)
	d.log.Info("datapath ready", "pins", dp.PinDir(), "adopted", dp.Adopted(), "cgroup", d.cfg.Cgroup)
	if used, err := dp.StorageUsed(); used {
		d.log.Warn("a build before this one kept sockets' states in socket storage, which recounts cannot count: they give back slots of freed sockets, never drift; `egressd uninstall` and a new start end this")
	} else if err != nil {
		d.log.Error("datapath", "err", err)
	}
	stack.push(func() error {
		if *detach {
			return dp.Uninstall()
		}
		return dp.Close()
	})
	stack.push(func() error { d.table.endShares(*detach); d.redis.close(); return nil })
	return nil
}

// listenMetrics opens the metrics listener; nil when metrics are off.
func (d *Daemon) listenMetrics() (net.Listener, error) {
	if d.cfg.MetricsAddr == "" {
		return nil, nil
	}
	ln, err := net.Listen("tcp", d.cfg.MetricsAddr)
	if err != nil {
		return nil, fmt.Errorf("metrics listener: %w", err)
	}
	return ln, nil
}

// serve starts the daemon's loops and servers, each in a goroutine that
// stack's cleanup stops and joins: the servers are shut down first, then
// the loops' context ends and they are waited for.
func (d *Daemon) serve(ctx context.Context, stack *cleanups, srv *controlserver.Server, ln, metricsLn net.Listener) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var readers []func() error
	stack.push(func() error {
		cancel()
		var errs []error
		for _, c := range readers {
			errs = append(errs, c())
		}
		d.events.close()
		wg.Wait()
		return errors.Join(errs...)
	})
	if rd, err := d.dp.Refusals(); err != nil {
		d.log.Error("refusal events", "err", err)
	} else {
		readers = append(readers, rd.Close)
		wg.Go(func() { d.followRefusals(rd) })
	}
	if rd, err := d.dp.Samples(); err != nil {
		d.log.Error("latency samples", "err", err)
	} else {
		readers = append(readers, rd.Close)
		wg.Go(func() { d.followSamples(rd) })
	}
	wg.Go(func() { d.table.watchSaturation(ctx) })
	wg.Go(func() { d.table.refreshLoop(ctx) })
	wg.Go(func() { d.recountLoop(ctx) })
	if d.kube != nil {
		wg.Go(func() {
			if err := d.kube.Run(ctx, kubeSink{d.table}); err != nil {
				d.log.Error("kubernetes", "err", err)
			}
		})
	}
	wg.Go(func() {
		if err := srv.Serve(ln); err != nil {
			d.log.Error("control server", "err", err)
		}
	})
	var metricsSrv *http.Server
	if metricsLn != nil {
		reg := prometheus.NewRegistry()
		reg.MustRegister(d.metrics)
		if d.kube != nil {
			reg.MustRegister(newKubeMetrics(d.kube))
		}
		metricsSrv = &http.Server{Handler: metricsHandler(reg), ReadHeaderTimeout: 10 * time.Second}
		wg.Go(func() {
			if err := metricsSrv.Serve(metricsLn); !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("metrics server", "err", err)
			}
		})
	}
	stack.push(func() error {
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err := srv.Shutdown(shutdown)
		if errors.Is(err, context.DeadlineExceeded) {
			// A request still running is cut rather than let fail the stop.
			d.log.Warn("control requests still running at stop; cutting them")
			err = srv.Close()
		}
		if metricsSrv != nil {
			err = errors.Join(err, metricsSrv.Shutdown(shutdown))
		}
		return err
	})
}

// wait tells the service manager the daemon is ready, saying how long the
// start that began then took, and runs until ctx ends or an uninstall request, reloading
// on each SIGHUP that hup brings and pinging the watchdog. It reports
// whether the daemon is to uninstall.
func (d *Daemon) wait(parent context.Context, hup <-chan os.Signal, began time.Time, took startTimes) (uninstall bool) {
	rules := d.table.size()
	// Logged before the service manager hears it: whoever waits for the
	// daemon to be ready finds the line there.
	d.log.Info("egressd running", "socket", d.cfg.Socket, "metrics", d.cfg.MetricsAddr, "rules", rules,
		"took", ms(time.Since(began)), "read", ms(took.read), "datapath_wait", ms(took.datapathWait), "install", ms(took.install))
	n := d.cfg.Notify
	n.Ready()
	defer n.Stopping()
	// SIGHUP's reloads run beside this loop, which goes on pinging the
	// watchdog while their lookups wait on DNS. When the loop ends, so
	// does a reload's waiting on DNS, and the reload is waited for
	// before the daemon says it stops or lets go of the datapath.
	ctx, cancel := context.WithCancel(parent)
	var reloads sync.WaitGroup
	defer reloads.Wait()
	defer cancel()
	hups := make(chan struct{}, 1)
	reloads.Go(func() { d.reloadOnHUP(ctx, hups) })
	var watchdog <-chan time.Time
	if every, ok := n.WatchdogInterval(); ok {
		t := time.NewTicker(every / 2)
		defer t.Stop()
		watchdog = t.C
	}
	for {
		select {
		case <-ctx.Done():
			// An uninstall already acknowledged to its caller still
			// happens when a stop comes at the same time.
			select {
			case <-d.stop:
				return true
			default:
				return false
			}
		case <-d.stop:
			return true
		case <-hup:
			select {
			case hups <- struct{}{}:
			default: // one is due already, and reads the file as it is then
			}
		case <-watchdog:
			n.Watchdog()
		}
	}
}

// reloadOnHUP reloads the policy each time want brings a value, until ctx
// ends.
func (d *Daemon) reloadOnHUP(ctx context.Context, want <-chan struct{}) {
	n := d.cfg.Notify
	for {
		select {
		case <-ctx.Done():
			return
		case <-want:
		}
		if ctx.Err() != nil {
			return // the stop came too, and select took either
		}
		n.Reloading()
		_, _ = d.reloadPolicy(ctx) // a refusal is logged, counted and in status
		n.Ready()
	}
}
