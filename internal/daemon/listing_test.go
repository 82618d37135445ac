package daemon

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/loader"
)

// list is what limit ls with q shows, for a writer.
func (td *testDaemon) list(t *testing.T, q control.LimitsQuery) []control.Limit {
	t.Helper()
	var out []control.Limit
	if err := td.listEach(q, func(l control.Limit) { out = append(out, l) }); err != nil {
		t.Fatal(err)
	}
	return out
}

// listEach calls fn with each rule limit ls with q shows, for a writer.
func (td *testDaemon) listEach(q control.LimitsQuery, fn func(control.Limit)) error {
	rows, read, err := td.Daemon.list.picked(q)
	if err != nil {
		return err
	}
	return td.Daemon.list.send(rows, read, false, func(l any) error { fn(l.(control.Limit)); return nil })
}

func listed(ls []control.Limit) string {
	var out []string
	for _, l := range ls {
		out = append(out, l.Name)
	}
	return strings.Join(out, " ")
}

// listPolicy has a rule of each shape, state and source a query picks
// by, among idle rules enough that a few are read one by one.
func listPolicy() string {
	var b strings.Builder
	b.WriteString(`rules:
  - {name: pay-eu, destination: 10.1.0.0/16, port: 443, concurrency: 5}
  - {name: pay-us, destination: 10.2.0.1, adaptive: {initial: 4}}
  - {name: hook, destination: 192.0.2.7, perSecond: {permits: 9}}
  - {name: batch, destination: 10.3.0.1, perWindow: {permits: 100, window: 1m}, shadow: true}
  - {name: later, destination: later.test, concurrency: 2}
`)
	for i := range 40 {
		fmt.Fprintf(&b, "  - {name: idle%02d, destination: 172.16.0.%d, concurrency: 1}\n", i, i)
	}
	return b.String()
}

// TestLimitsPick: each filter keeps the rules it names, Max the first of
// them in the list's order, and every row says what the view of its rule
// alone says, whether the list read each rule or every rule at once.
func TestLimitsPick(t *testing.T) {
	td := newTestDaemon(t)
	td.apply(t, listPolicy())
	if err := td.table.set(context.Background(), parse(t, "rules:\n  - {name: manual, destination: 10.9.9.9, concurrency: 3}\n").Rules[0], time.Now()); err != nil {
		t.Fatal(err)
	}
	td.fake.set("pay-eu", loader.Stats{Live: 2, Admitted: 9, Refused: 1})
	tests := []struct {
		name string
		q    control.LimitsQuery
		want string
	}{
		{"pending", control.LimitsQuery{State: control.StatePending}, "later"},
		{"shadow", control.LimitsQuery{State: control.StateShadow}, "batch"},
		{"installed, first three", control.LimitsQuery{State: control.StateInstalled, Max: 3}, "batch hook idle00"},
		{"shape as limit ls shows it", control.LimitsQuery{Shape: "per_second"}, "hook"},
		{"shape as the policy writes it", control.LimitsQuery{Shape: "perWindow"}, "batch"},
		{"adaptive", control.LimitsQuery{Shape: "adaptive"}, "pay-us"},
		{"name pattern", control.LimitsQuery{Name: "pay-*"}, "pay-eu pay-us"},
		{"an address in a prefix", control.LimitsQuery{Dest: "10.1.2.3"}, "pay-eu"},
		{"a prefix over rules", control.LimitsQuery{Dest: "10.0.0.0/8"}, "batch manual pay-eu pay-us"},
		{"a host name", control.LimitsQuery{Dest: "LATER.test."}, "later"},
		{"set at run time", control.LimitsQuery{Source: "cli"}, "manual"},
		{"several at once", control.LimitsQuery{Name: "pay-*", Shape: "concurrency", Dest: "10.1.0.0/16"}, "pay-eu"},
		{"nothing", control.LimitsQuery{Name: "nothing*"}, ""},
		{"max beyond the rules", control.LimitsQuery{Name: "pay-*", Max: 10}, "pay-eu pay-us"},
	}
	for _, tt := range tests {
		list := td.list(t, tt.q)
		if got := listed(list); got != tt.want {
			t.Errorf("%s: listed %q, want %q", tt.name, got, tt.want)
		}
		for _, l := range list {
			one, err := td.api.limitView(l.Name, false)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(l, one) {
				t.Errorf("%s: %s in the list:\n%+v\nalone:\n%+v", tt.name, l.Name, l, one)
			}
		}
	}
	if n := len(td.list(t, control.LimitsQuery{})); n != 46 {
		t.Errorf("the whole list has %d rules, want 46", n)
	}
}

// TestLimitsBusy: sorted by how busy they are, the rules refusing most
// lately come first, then those with the most live connections, then
// the rest by name.
func TestLimitsBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		td := newTestDaemon(t)
		td.apply(t, listPolicy())
		td.list(t, control.LimitsQuery{Sort: control.SortBusy}) // the first read: no refusals yet
		clocktest.Advance(10 * time.Second)                     // the bubble's clock
		td.fake.set("hook", loader.Stats{Refused: 500})
		td.fake.set("idle39", loader.Stats{Refused: 20})
		td.fake.set("pay-us", loader.Stats{Live: 4})
		got := listed(td.list(t, control.LimitsQuery{Sort: control.SortBusy, Max: 5}))
		if want := "hook idle39 pay-us batch idle00"; got != want {
			t.Errorf("busiest five: %q, want %q", got, want)
		}
		got = listed(td.list(t, control.LimitsQuery{Sort: control.SortBusy, Name: "idle*", Max: 2}))
		if want := "idle39 idle00"; got != want {
			t.Errorf("busiest two idle*: %q, want %q", got, want)
		}
	})
}

// TestLimitsOverSocket: the list streams over the control socket, and a
// query the daemon cannot judge is refused before it starts.
func TestLimitsOverSocket(t *testing.T) {
	td := newTestDaemon(t)
	writeFile(t, td.cfg.PolicyFile, listPolicy())
	td.start(t)
	var got []string
	err := td.client().Limits(context.Background(), control.LimitsQuery{Name: "pay-*"}, func(l control.Limit) error {
		got = append(got, l.Name)
		return nil
	})
	if err != nil || strings.Join(got, " ") != "pay-eu pay-us" {
		t.Errorf("listed %q, %v; want pay-eu pay-us", got, err)
	}
	for _, q := range []control.LimitsQuery{
		{State: "busy"}, {Shape: "granted"}, {Name: "[x"}, {Dest: "10.0.0.0/33"}, {Source: "file"}, {Sort: "live"},
	} {
		err := td.client().Limits(context.Background(), q, func(control.Limit) error { return nil })
		if !errors.Is(err, control.ErrInvalid) {
			t.Errorf("%+v: %v, want invalid", q, err)
		}
	}
}
