package daemon

import (
	"context"
	"time"

	"github.com/egressd/egressd/pkg/loader"
)

// recountLoop recounts the sockets holding slots every RecountEvery.
func (d *Daemon) recountLoop(ctx context.Context) {
	t := time.NewTicker(d.cfg.RecountEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d.recount()
		}
	}
}

// recount recounts the sockets holding slots, which gives back the slots
// none holds and puts back the marks other programs took off, and says
// so: for each rule, a line of the log and an event for the slots given
// back, the metrics for all.
func (d *Daemon) recount() {
	rc, err := d.dp.Recount()
	if err != nil {
		d.log.Error("recount", "err", err)
		return
	}
	now := time.Now()
	for name, r := range rc {
		if r.Drift() != 0 {
			d.log.Warn("recount drift", "rule", name, "kernel", r.Live, "sockets", r.Counted, "admitted", r.Admitted, "released", r.Released)
		}
		if r.Freed+r.GivenBack > 0 {
			d.log.Warn("recount gave slots back", "rule", name, "freed_sockets", r.Freed, "held_by_no_socket", r.GivenBack)
			g := r
			d.events.add(event{Refusal: loader.Refusal{Time: now, Rule: name}, gaveBack: &g})
		}
		if r.Remarked > 0 {
			d.log.Info("recount put marks back", "rule", name, "sockets", r.Remarked)
		}
	}
	d.metrics.recorded(rc)
}
