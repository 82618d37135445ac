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
)

// The list of rules (limit ls, top): those a query picks, in its order,
// each sent as soon as its counts are read. With 100,000 rules the list
// of them all took 1.7 s and came whole; a query for the rules that
// matter reads and sends only them.

// handleLimits streams the rules the request's query picks.
func (d *Daemon) handleLimits(w http.ResponseWriter, r *http.Request) error {
	q, err := control.ParseLimitsQuery(r.URL.Query())
	if err != nil {
		return err
	}
	// Picked before the answer starts, so that a kernel that cannot be
	// read is an error status, not a broken stream.
	rows, read, err := d.picked(q)
	if err != nil {
		return err
	}
	sw, err := controlserver.NewStreamWriter(w)
	if err != nil {
		return err
	}
	if err := d.sendRows(rows, read, readOnly(r), sw.Queue); err != nil {
		return err
	}
	return sw.Flush()
}

// limits calls fn with each rule q picks, as the handler sends them.
func (d *Daemon) limits(q control.LimitsQuery, forReader bool, fn func(control.Limit) error) error {
	rows, read, err := d.picked(q)
	if err != nil {
		return err
	}
	return d.sendRows(rows, read, forReader, func(v any) error { return fn(v.(control.Limit)) })
}

// picked is pickRules of q, once it is checked.
func (d *Daemon) picked(q control.LimitsQuery) ([]viewed, map[string]*counted, error) {
	p, err := newPick(q)
	if err != nil {
		return nil, nil, err
	}
	return d.pickRules(p)
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
	case "", sourcePolicy, sourceCLI:
	default:
		return invalid("source %q is not policy or cli", q.Source)
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
	if p.q.Source != "" && e.source != p.q.Source {
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

// pickRules returns the rules p picks, in its order, and with counts
// the kernel's counts of them when it was quicker to read every rule's
// than each one's (nil: read each). The table's order is replaced, never
// written in place, and a rule's name is its spec's, which never
// changes: the rules are ranked by their places in it outside its lock.
func (d *Daemon) pickRules(p pick) ([]viewed, map[string]*counted, error) {
	d.mu.Lock()
	order := d.order
	var places []int
	installed := 0
	for i, e := range order {
		if e.installed() {
			installed++
		}
		if p.matches(viewedLocked(e.spec.Name, e)) {
			places = append(places, i)
		}
	}
	d.mu.Unlock()
	name := func(i int) string { return order[i].spec.Name }
	switch {
	case p.q.Sort == control.SortBusy:
		var err error
		if places, err = d.busiest(name, places, p.q.Max); err != nil {
			return nil, nil, err
		}
	case p.q.Max > 0 && p.q.Max < len(places):
		places = best(slices.Values(places), p.q.Max, func(a, b int) bool { return name(a) < name(b) })
	default:
		slices.SortFunc(places, func(a, b int) int { return strings.Compare(name(a), name(b)) })
	}
	rows := make([]viewed, len(places))
	d.mu.Lock()
	for i, at := range places {
		rows[i] = viewedLocked(name(at), order[at])
	}
	d.mu.Unlock()
	if len(rows)*8 < installed {
		return rows, nil, nil
	}
	all, err := d.countRows(rows)
	return rows, all, err
}

// busiest orders the rules at places in the table by how busy they have
// been lately, and keeps max of them (0: all): a read of every rule's
// counts moves their averages, and finds each rule at its place.
func (d *Daemon) busiest(name func(int) string, places []int, max int) ([]int, error) {
	if max <= 0 {
		max = len(places)
	}
	type ranked struct {
		c     candidate
		place int
	}
	var kept []ranked
	_, err := d.metrics.read(func(t *tracker) {
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
func (d *Daemon) countRows(rows []viewed) (map[string]*counted, error) {
	out := make(map[string]*counted, len(rows))
	for _, v := range rows {
		if v.e.installed() {
			out[v.name] = nil
		}
	}
	err := d.dp.Counts(func(r *loader.Rule, s *loader.Stats) {
		if _, ok := out[r.Name]; ok {
			out[r.Name] = &counted{live: s.Live, inFlight: s.InFlight, admitted: s.Admitted, refused: s.Refused,
				shadowRefused: s.ShadowRefused, spent: s.Spent, limit: r.Limit}
		}
	})
	return out, err
}

// sendRows describes each row, with the counts in all or, when all is
// nil, read for it alone, and sends it.
func (d *Daemon) sendRows(rows []viewed, all map[string]*counted, forReader bool, send func(any) error) error {
	for _, v := range rows {
		var st loader.Stats
		var kr loader.Rule
		if v.e.installed() {
			if all == nil {
				var err error
				st, kr, err = d.kernelView(v.name)
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
func (d *Daemon) kernelView(name string) (loader.Stats, loader.Rule, error) {
	st, err := d.dp.Stats(name)
	if err != nil {
		return st, loader.Rule{}, err
	}
	kr, err := d.dp.Rule(name)
	return st, kr, err
}
