package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/internal/kube"
	"github.com/egressd/egressd/pkg/adaptive"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// api is the control API's handlers: what status, limits, events and
// attribution show, and the changes a writer asks for (limits, reload,
// uninstall). Package controlserver serves them and checks who may call
// which.
type api struct {
	cfg     *Config
	log     *slog.Logger
	dp      datapath
	started time.Time
	table   *table
	list    *lister
	events  *eventLog
	// reload reloads the policy file; uninstall asks the daemon to stop
	// and take the datapath down.
	reload    func(context.Context) (control.Reload, error)
	uninstall func()
	kube      *kube.Source // nil without one
}

func (a *api) routes() map[string]controlserver.Route {
	get := func(h controlserver.HandlerFunc) controlserver.Route {
		return controlserver.Route{Method: http.MethodGet, Handler: h}
	}
	post := func(h controlserver.HandlerFunc) controlserver.Route {
		return controlserver.Route{Method: http.MethodPost, Write: true, Handler: h}
	}
	return map[string]controlserver.Route{
		control.RouteStatus:       get(controlserver.JSON(a.handleStatus)),
		control.RouteLimits:       {Method: http.MethodGet, Stream: true, Handler: a.handleLimits},
		control.RouteLimit:        get(controlserver.JSON(a.handleLimit)),
		control.RouteLimitSet:     post(controlserver.JSON(a.handleSetLimit)),
		control.RouteLimitRemove:  post(controlserver.JSON(a.handleRemoveLimit)),
		control.RoutePolicyReload: post(controlserver.JSON(a.handleReload)),
		control.RouteEvents:       {Method: http.MethodGet, Stream: true, Handler: a.handleEvents},
		control.RouteRefusal:      get(controlserver.JSON(a.handleRefusal)),
		control.RouteUninstall:    post(controlserver.JSON(a.handleUninstall)),
	}
}

func (a *api) handleStatus(r *http.Request, _ struct{}) (control.Status, error) {
	lost, err := a.dp.Lost()
	if err != nil {
		return control.Status{}, err
	}
	s := control.Status{
		Version:      a.cfg.Version,
		Started:      a.started,
		Adopted:      a.dp.Adopted(),
		Cgroup:       a.cfg.Cgroup,
		PinDir:       a.dp.PinDir(),
		PolicyFile:   a.cfg.PolicyFile,
		LostRefusals: lost.Refusals,
		LostSamples:  lost.Samples,
	}
	a.table.describe(&s)
	if a.kube != nil {
		s.Kube = kubeStatus(a.kube.Status())
	}
	return s, nil
}

func (a *api) handleLimit(r *http.Request, _ struct{}) (control.Limit, error) {
	name := r.URL.Query().Get("name")
	if name == "" {
		return control.Limit{}, control.Errorf(control.CodeInvalid, "name is required")
	}
	return a.limitView(name, readOnly(r))
}

// readOnly says whether r's caller may read but not write.
func readOnly(r *http.Request) bool {
	return controlserver.AccessFrom(r.Context()) < controlserver.AccessWrite
}

// limitView describes one rule with its kernel counts, for a reader if
// forReader.
func (a *api) limitView(name string, forReader bool) (control.Limit, error) {
	v, ok := a.table.viewOf(name)
	if !ok {
		return control.Limit{}, control.Errorf(control.CodeNotFound, "rule %s: %v", name, errUnknownRule)
	}
	if !v.e.installed() {
		return view(v, loader.Stats{}, loader.Rule{}, forReader)
	}
	st, kr, err := kernelView(a.dp, name)
	if err != nil {
		return control.Limit{}, err
	}
	return view(v, st, kr, forReader)
}

// viewed is a rule as the views read it: its entry, and what of the entry
// changes in place, taken under the table's lock (an adaptive loop's push
// and a share's write replace the kernel rule).
type viewed struct {
	name  string
	e     *entry
	dests []netip.Prefix // the kernel rule's, whose array no write changes
}

// viewedLocked is e, the entry of rule name, as the views read it. Call
// with the table's lock held.
func viewedLocked(name string, e *entry) viewed {
	return viewed{name: name, e: e, dests: e.kernel.Dests}
}

// view describes rule v, given its kernel counts st and kernel rule kr
// when it is installed; for a reader if forReader.
func view(v viewed, st loader.Stats, kr loader.Rule, forReader bool) (control.Limit, error) {
	name, e := v.name, v.e
	textOf := e.text
	if forReader {
		textOf = e.readerText
	}
	text, err := textOf()
	if err != nil {
		return control.Limit{}, err
	}
	l := control.Limit{
		Name:         name,
		Source:       e.source,
		Rule:         text,
		Shape:        shapeName(e),
		Shadow:       e.spec.Shadow,
		Pending:      e.pending,
		Destinations: []string{},
		Protocols:    strings.Split(e.spec.Protocols.String(), ","),
	}
	if !e.installed() {
		return l, nil
	}
	for _, p := range v.dests {
		l.Destinations = append(l.Destinations, p.String())
	}
	l.Limit = e.limitShown(kr.Limit)
	if e.share != nil {
		l.Shared = e.share.view().control(st)
	}
	l.Live, l.InFlight = st.Live, st.InFlight
	l.Admitted, l.Refused, l.ShadowRefused = st.Admitted, st.Refused, st.ShadowRefused
	l.SettledLimit = l.Limit
	if e.ctrl != nil {
		st := e.ctrl.State()
		l.BaselineSeconds, l.Probes = st.Baseline.Seconds(), st.Probes
		if st.Source != adaptive.NoSource {
			l.BaselineSource = st.Source.String()
		}
		l.LastProbe, l.NextProbe, l.NoProbes = st.LastProbe, st.NextProbe, st.NoProbes
		if st.Probing {
			l.Probing, l.SettledLimit = true, uint32(st.Settled)
		}
	}
	return l, nil
}

func shapeName(e *entry) string {
	if _, ok := e.spec.Limit.(policy.Adaptive); ok {
		return "adaptive"
	}
	// The policy's shape: a shared rate is granted in the kernel.
	return e.spec.LoaderRule(loader.Scope{}, nil).Shape.String()
}

func (a *api) handleSetLimit(r *http.Request, in control.SetLimitRequest) (control.Limit, error) {
	p, err := policy.Parse([]byte("rules:\n" + indent(in.Rule)))
	var pe *policy.Error
	if errors.As(err, &pe) {
		// Positions in a YAML the caller never wrote would only confuse.
		msgs := make([]string, len(pe.Problems))
		for i, pr := range pe.Problems {
			msgs[i] = pr.Msg
			if pr.Rule != "" {
				msgs[i] = "rule " + pr.Rule + ": " + pr.Msg
			}
		}
		return control.Limit{}, control.Errorf(control.CodeInvalid, "%s", strings.Join(msgs, "\n"))
	}
	if err != nil {
		return control.Limit{}, control.Errorf(control.CodeInvalid, "%v", err)
	}
	if len(p.Rules) != 1 {
		return control.Limit{}, control.Errorf(control.CodeInvalid, "want exactly one rule, got %d", len(p.Rules))
	}
	if err := a.table.set(r.Context(), p.Rules[0], time.Now()); err != nil {
		return control.Limit{}, applyError(err)
	}
	return a.limitView(p.Rules[0].Name, false)
}

// indent makes one rule's YAML an item of a rules list.
func indent(rule string) string {
	lines := strings.Split(strings.TrimRight(rule, "\n"), "\n")
	for i, l := range lines {
		prefix := "    "
		if i == 0 {
			prefix = "  - "
		}
		lines[i] = prefix + l
	}
	return strings.Join(lines, "\n") + "\n"
}

func (a *api) handleRemoveLimit(r *http.Request, in control.NameRequest) (struct{}, error) {
	err := a.table.remove(r.Context(), in.Name, time.Now())
	if errors.Is(err, errUnknownRule) {
		return struct{}{}, control.Errorf(control.CodeNotFound, "rule %s: %v", in.Name, err)
	}
	return struct{}{}, applyError(err)
}

// applyError sorts a refused change into the client's error codes.
func applyError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, policy.ErrInvalid), errors.Is(err, loader.ErrInvalidRule), errors.Is(err, errKubeRule):
		return control.Errorf(control.CodeInvalid, "%v", err)
	case errors.Is(err, loader.ErrConflict), errors.Is(err, loader.ErrFull):
		return control.Errorf(control.CodeConflict, "%v", err)
	}
	return err
}

func (a *api) handleReload(r *http.Request, _ struct{}) (control.Reload, error) {
	rl, err := a.reload(r.Context())
	if err != nil {
		return rl, applyError(err)
	}
	return rl, nil
}

func (a *api) handleEvents(w http.ResponseWriter, r *http.Request) error {
	follow, _ := strconv.ParseBool(r.URL.Query().Get("follow"))
	// A reader learns about its own connections only, as with
	// attribution.
	shown := func(event) bool { return true }
	var who follower
	if readOnly(r) {
		peer, known := controlserver.PeerFrom(r.Context())
		if !known {
			return control.Errorf(control.CodeForbidden, "the asking process is not known")
		}
		shown = func(e event) bool { return e.gaveBack == nil && e.PID == uint32(peer.PID) }
		who = follower{reader: true, uid: peer.UID}
	}
	var live <-chan event
	var kept []event
	if follow {
		k, ch, cancel, err := a.events.follow(who)
		if err != nil {
			return control.Errorf(control.CodeUnavailable, "%v", err)
		}
		defer cancel()
		kept, live = k, ch
	} else {
		kept = a.events.recent()
	}
	sw, err := controlserver.NewStreamWriter(w)
	if err != nil {
		return err
	}
	for _, e := range kept {
		if !shown(e) {
			continue
		}
		if err := sw.Send(a.eventView(e)); err != nil {
			return err
		}
	}
	if !follow {
		return nil
	}
	keepalive := time.NewTicker(a.cfg.keepalive)
	defer keepalive.Stop()
	for {
		select {
		case <-r.Context().Done():
			return r.Context().Err()
		case <-keepalive.C:
			if err := sw.Keepalive(); err != nil {
				return err
			}
		case e, ok := <-live:
			if !ok {
				return nil
			}
			if !shown(e) {
				continue
			}
			if err := sw.Send(a.eventView(e)); err != nil {
				return err
			}
		}
	}
}

// eventView shows an event with its rule's shape as the policy gives it,
// as limit ls does: the kernel enforces an adaptive rule as a concurrency
// limit and a shared rate as granted permits.
func (a *api) eventView(e event) control.Event {
	shape := e.Shape.String()
	if e.gaveBack != nil {
		shape = "" // a recount knows no shape; the rule may have gone
	}
	if s, ok := a.table.shapeOf(e.Rule); ok {
		shape = s
	}
	if g := e.gaveBack; g != nil {
		return control.Event{
			Kind:      control.EventRecount,
			Time:      e.Time,
			Rule:      e.Rule,
			Shape:     shape,
			Count:     uint64(g.Freed + g.GivenBack),
			Freed:     g.Freed,
			GivenBack: g.GivenBack,
		}
	}
	return control.Event{
		Kind:              control.EventRefusal,
		Time:              e.Time,
		PID:               e.PID,
		Cgroup:            e.Cgroup,
		Rule:              e.Rule,
		Dest:              e.Dest.String(),
		Shape:             shape,
		Shadow:            e.Shadow,
		Protocol:          e.Protocol.String(),
		RetryAfterSeconds: e.RetryAfter.Seconds(),
		Count:             e.Count,
	}
}

func (a *api) handleRefusal(r *http.Request, _ struct{}) (control.Attribution, error) {
	q := r.URL.Query()
	pid, err := strconv.ParseUint(q.Get("pid"), 10, 32)
	if err != nil {
		return control.Attribution{}, control.Errorf(control.CodeInvalid, "pid: %v", err)
	}
	dest, err := netip.ParseAddrPort(q.Get("dest"))
	if err != nil {
		return control.Attribution{}, control.Errorf(control.CodeInvalid, "dest: %v", err)
	}
	proto := loader.ProtoTCP // what an SDK that does not say asks about
	if name := q.Get("proto"); name != "" {
		p, ok := kernelrule.ParseProtocol(name)
		if !ok {
			return control.Attribution{}, control.Errorf(control.CodeInvalid, "proto %q: not tcp or udp", name)
		}
		proto = p
	}
	peer, known := controlserver.PeerFrom(r.Context())
	// 0 is the asking process, by the pid the kernel gives it here: in a
	// container's pid namespace, its own pid names another process.
	if pid == 0 {
		if !known {
			return control.Attribution{}, control.Errorf(control.CodeInvalid, "pid 0: the asking process is not known")
		}
		pid = uint64(uint32(peer.PID))
	}
	// A reader learns about its own connections only.
	if controlserver.AccessFrom(r.Context()) != controlserver.AccessWrite && (!known || uint32(peer.PID) != uint32(pid)) {
		return control.Attribution{}, control.Errorf(control.CodeForbidden, "may ask only about your own process")
	}
	e, ok := a.attribute(uint32(pid), proto, netip.AddrPortFrom(dest.Addr().Unmap(), dest.Port()))
	if !ok {
		return control.Attribution{}, nil
	}
	return control.Attribution{Refused: true, Rule: e.Rule, RetryAfterSeconds: e.RetryAfter.Seconds(), SecondsAgo: max(0, time.Since(e.Time).Seconds())}, nil
}

func (a *api) handleUninstall(r *http.Request, _ struct{}) (struct{}, error) {
	a.log.Warn("uninstall requested: detaching and exiting")
	a.uninstall()
	return struct{}{}, nil
}
