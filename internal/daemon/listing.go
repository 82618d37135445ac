package daemon

import (
	"errors"
	"net/http"
	"net/netip"
	"path"
	"slices"
	"strings"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

// lister lists rules (limit ls, top): those a query picks, in its order,
// each sent as soon as its counts are read, so that a query for the rules
// that matter among 100,000 reads and sends only them.
type lister struct {
	table   *table
	dp      datapath
	metrics *metrics // busiest reads the counts every rule's averages come from
}

// handleLimits streams the rules the request's query picks.
func (a *api) handleLimits(w http.ResponseWriter, r *http.Request) error {
	q, err := control.ParseLimitsQuery(r.URL.Query())
	if err != nil {
		return err
	}
	// Picked before the answer starts, so that a kernel that cannot be
	// read is an error status, not a broken stream.
	rows, read, err := a.list.picked(q)
	if err != nil {
		return err
	}
	sw, err := controlserver.NewStreamWriter(w)
	if err != nil {
		return err
	}
	if err := a.list.send(rows, read, readOnly(r), sw.Queue); err != nil {
		return err
	}
	return sw.Flush()
}

// picked is find of q, once it is checked.
func (l *lister) picked(q control.LimitsQuery) ([]viewed, map[string]*counted, error) {
	p, err := newPick(q)
	if err != nil {
		return nil, nil, err
	}
	return l.find(p)
}

// pick is a LimitsQuery, checked.
type pick struct {
	q control.LimitsQuery
	// shape is the class's name of q.Shape.
	shape string
	// dest is q.Dest as an address or a prefix; host when it is a name.
	dest netip.Prefix
	host string
}

// listShapes are the shapes a query may name, as Limit.Shape and the
// policy write them, and the class's name of each.
var listShapes = map[string]string{
	"concurrency": "concurrency", "adaptive": "adaptive",
	"per_second": "perSecond", "perSecond": "perSecond",
	"per_window": "perWindow", "perWindow": "perWindow",
}

func newPick(q control.LimitsQuery) (pick, error) {
	p := pick{q: q}
	invalid := func(format string, args ...any) (pick, error) {
		return pick{}, control.Errorf(control.CodeInvalid, format, args...)
	}
	switch q.State {
	case "", control.StateInstalled, control.StatePending, control.StateShadow, control.StateShared:
	default:
		return invalid("state %q is not installed, pending, shadow or shared", q.State)
	}
	if q.Shape != "" {
		if p.shape = listShapes[q.Shape]; p.shape == "" {
			return invalid("shape %q is not concurrency, adaptive, per_second or per_window", q.Shape)
		}
	}
	if _, err := path.Match(q.Name, ""); err != nil {
		return invalid("name %q is not a pattern: %v", q.Name, err)
	}
	switch q.Source {
	case "", sourcePolicy, sourceCLI, sourceKube:
	default:
		if !strings.HasPrefix(q.Source, policy.KubePrefix) {
			return invalid("source %q is not policy, cli, k8s or k8s:NAMESPACE/NAME", q.Source)
		}
	}
	switch q.Sort {
	case "", control.SortName, control.SortBusy:
	default:
		return invalid("sort %q is not name or busy", q.Sort)
	}
	switch d := q.Dest; {
	case d == "":
	case strings.Contains(d, "/"):
		prefix, err := netip.ParsePrefix(d)
		if err != nil {
			return invalid("dest %q is not an address, a prefix or a host name: %v", d, err)
		}
		p.dest = prefix.Masked()
	default:
		if a, err := netip.ParseAddr(d); err == nil {
			p.dest = netip.PrefixFrom(a, a.BitLen())
		} else {
			p.host = strings.TrimSuffix(d, ".")
		}
	}
	return p, nil
}

// matches reports whether the query keeps rule v.
func (p pick) matches(v viewed) bool {
	e := v.e
	switch p.q.State {
	case control.StateInstalled:
		if !e.installed() {
			return false
		}
	case control.StatePending:
		if e.installed() {
			return false
		}
	case control.StateShadow:
		if !e.spec.Shadow {
			return false
		}
	case control.StateShared:
		if !e.spec.IsShared() {
			return false
		}
	}
	if p.shape != "" && classOf(e).shape() != p.shape {
		return false
	}
	if p.q.Source != "" && e.source != p.q.Source && (p.q.Source != sourceKube || !strings.HasPrefix(e.source, policy.KubePrefix)) {
		return false
	}
	if p.q.Name != "" {
		if ok, _ := path.Match(p.q.Name, v.name); !ok {
			return false
		}
	}
	switch {
	case p.host != "":
		host, ok := e.spec.Destination.Host()
		return ok && strings.EqualFold(strings.TrimSuffix(host, "."), p.host)
	case p.dest.IsValid():
		dests := v.dests
		if pre, ok := e.spec.Destination.Prefix(); ok && !e.installed() {
			dests = []netip.Prefix{pre}
		}
		return slices.ContainsFunc(dests, func(d netip.Prefix) bool { return d.Overlaps(p.dest) })
	}
	return true
}

// find returns the rules p picks, in its order, and with counts the
// kernel's counts of them when it was quicker to read every rule's than
// each one's (nil: read each).
func (l *lister) find(p pick) ([]viewed, map[string]*counted, error) {
	order, places, installed := l.table.match(p)
	name := func(i int) string { return order[i].spec.Name }
	switch {
	case p.q.Sort == control.SortBusy:
		var err error
		if places, err = l.busiest(name, places, p.q.Max); err != nil {
			return nil, nil, err
		}
	case p.q.Max > 0 && p.q.Max < len(places):
		places = best(slices.Values(places), p.q.Max, func(a, b int) bool { return name(a) < name(b) })
	default:
		slices.SortFunc(places, func(a, b int) int { return strings.Compare(name(a), name(b)) })
	}
	rows := l.table.viewsAt(order, places)
	if len(rows)*8 < installed {
		return rows, nil, nil
	}
	all, err := l.countRows(rows)
	return rows, all, err
}

// busiest orders the rules at places in the table by how busy they have
// been lately, and keeps max of them (0: all): a read of every rule's
// counts moves their averages, and finds each rule at its place.
func (l *lister) busiest(name func(int) string, places []int, max int) ([]int, error) {
	if max <= 0 {
		max = len(places)
	}
	type ranked struct {
		c     candidate
		place int
	}
	var kept []ranked
	_, err := l.metrics.read(func(t *tracker) {
		each := func(yield func(ranked) bool) {
			for _, at := range places {
				r := ranked{c: candidate{name: name(at)}, place: at}
				if tr := t.find(&t.byTable, at, r.c.name); tr != nil {
					r.c.refusing, r.c.live = tr.refusing, tr.live
				}
				if !yield(r) {
					return
				}
			}
		}
		kept = best(each, max, func(a, b ranked) bool { return busier(a.c, b.c) })
	})
	if err != nil {
		return nil, err
	}
	out := make([]int, len(kept))
	for i, k := range kept {
		out[i] = k.place
	}
	return out, nil
}

// counted is what a listing shows of a rule's counts, kept for each row
// while the kernel is read in its own order.
type counted struct {
	live, inFlight                          int64
	admitted, refused, shadowRefused, spent uint64
	limit                                   uint32
}

// countRows reads every rule's counts at once and keeps those of rows.
func (l *lister) countRows(rows []viewed) (map[string]*counted, error) {
	out := make(map[string]*counted, len(rows))
	for _, v := range rows {
		if v.e.installed() {
			out[v.name] = nil
		}
	}
	err := l.dp.Counts(func(r *loader.Rule, s *loader.Stats) {
		if _, ok := out[r.Name]; ok {
			out[r.Name] = &counted{live: s.Live, inFlight: s.InFlight, admitted: s.Admitted, refused: s.Refused,
				shadowRefused: s.ShadowRefused, spent: s.Spent, limit: r.Limit}
		}
	})
	return out, err
}

// send describes each row, with the counts in all or, when all is nil,
// read for it alone, and sends it.
func (l *lister) send(rows []viewed, all map[string]*counted, forReader bool, send func(any) error) error {
	for _, v := range rows {
		var st loader.Stats
		var kr loader.Rule
		if v.e.installed() {
			if all == nil {
				var err error
				st, kr, err = kernelView(l.dp, v.name)
				if errors.Is(err, loader.ErrUnknownRule) {
					continue // removed after the table was read
				}
				if err != nil {
					return err
				}
			} else if c := all[v.name]; c != nil {
				st = loader.Stats{Live: c.live, InFlight: c.inFlight, Admitted: c.admitted, Refused: c.refused,
					ShadowRefused: c.shadowRefused, Spent: c.spent}
				kr.Limit = c.limit
			} else {
				continue // removed after the table was read
			}
		}
		l, err := view(v, st, kr, forReader)
		if err != nil {
			return err
		}
		if err := send(l); err != nil {
			return err
		}
	}
	return nil
}

// kernelView reads one rule's counts and kernel rule.
func kernelView(dp datapath, name string) (loader.Stats, loader.Rule, error) {
	st, err := dp.Stats(name)
	if err != nil {
		return st, loader.Rule{}, err
	}
	kr, err := dp.Rule(name)
	return st, kr, err
}
