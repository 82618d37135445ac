package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
	"github.com/egressd/egressd/pkg/policy"
)

// setDaemon serves limit/set on a control socket of the test's own and
// records each rule it is sent.
func setDaemon(t *testing.T) (sock string, sent *[]string) {
	t.Helper()
	sent = new([]string)
	return serveRoutes(t, map[string]controlserver.Route{
		control.RouteLimitSet: {Method: http.MethodPost, Handler: controlserver.JSON(func(_ *http.Request, in control.SetLimitRequest) (control.Limit, error) {
			*sent = append(*sent, in.Rule)
			return control.Limit{Name: "x", Shape: "concurrency", Source: "cli", Rule: in.Rule}, nil
		})},
	}), sent
}

// TestLimitSet: the flags become one policy rule, written by package
// policy, which reads it back as the rule the flags describe; every
// problem, the flags' and the rule's, is named at once and nothing is sent.
func TestLimitSet(t *testing.T) {
	tests := []struct {
		name string
		args string
		want string   // the rule sent, as policy YAML
		errs []string // or the problems, and nothing sent
	}{{
		name: "concurrency",
		args: "--dest 10.0.0.1 --port 443 --unit web.service --concurrency 5 --errno ECONNREFUSED",
		want: "name: x\ndestination: 10.0.0.1\nport: 443\nunit: web.service\nconcurrency: 5\nerrno: ECONNREFUSED\n",
	}, {
		name: "per second, burst and a cgroup",
		args: "--dest db.internal --scope /a.slice/b --per-second 10 --burst 20 --shadow",
		want: "name: x\ndestination: db.internal\ncgroup: /a.slice/b\nperSecond: {permits: 10, burst: 20}\nshadow: true\n",
	}, {
		name: "per window",
		args: "--dest 10.0.0.0/8 --per-window 100 --window 1m --segments 4",
		want: "name: x\ndestination: 10.0.0.0/8\nperWindow: {permits: 100, window: 1m0s, segments: 4}\n",
	}, {
		name: "adaptive with every default",
		args: "--dest ::1 --adaptive",
		want: "name: x\ndestination: ::1\nadaptive: {}\n",
	}, {
		name: "adaptive, tuned",
		args: "--dest ::1 --adaptive --max 50 --min 2 --initial 10 --multiple 3 --decrease-factor 0.8 --probe-every 20 --probe-factor 0.25 --samples request",
		want: "name: x\ndestination: ::1\nadaptive: {minimum: 2, maximum: 50, initial: 10, multiple: 3, decreaseFactor: 0.8, probeEvery: 20, probeFactor: 0.25, samples: request}\n",
	}, {
		name: "shared",
		args: "--dest 10.0.0.1 --concurrency 10 --shared-redis redis://r:6379 --shared-key k --shared-failure-mode deny",
		want: "name: x\ndestination: 10.0.0.1\nconcurrency: 10\nshared: {redis: 'redis://r:6379', key: k, failureMode: deny}\n",
	}, {
		name: "shared with Sentinel",
		args: "--dest 10.0.0.1 --concurrency 10 --shared-redis redis+sentinel://s:26379?master_name=m --shared-key k --shared-durability persistent --shared-lease 30s --shared-replicas 1",
		want: "name: x\ndestination: 10.0.0.1\nconcurrency: 10\nshared: {redis: 'redis+sentinel://s:26379?master_name=m', key: k, durability: persistent, lease: 30s, replicas: 1}\n",
	}, {
		name: "no limit",
		args: "--dest 10.0.0.1",
		errs: []string{"rule x: no limit: give one of concurrency, perSecond, perWindow or adaptive"},
	}, {
		name: "two shapes, said once",
		args: "--dest 10.0.0.1 --concurrency 2 --per-second 5 --burst 6",
		errs: []string{"rule x: concurrency and perSecond are both given; a rule has one limit"},
	}, {
		name: "zero for a default",
		args: "--dest 10.0.0.1 --per-second 5 --burst 0",
		errs: []string{"rule x: --burst 0 is not allowed; leave it out for the default"},
	}, {
		name: "a flag without the flag it needs",
		args: "--dest 10.0.0.1 --burst 5",
		errs: []string{"rule x: --burst needs --per-second"},
	}, {
		name: "a window without permits",
		args: "--dest 10.0.0.1 --window 1m",
		errs: []string{"rule x: --window needs --per-window"},
	}, {
		name: "permits without a window",
		args: "--dest 10.0.0.1 --per-window 5",
		errs: []string{"rule x: --per-window needs --window"},
	}, {
		name: "segments alone",
		args: "--dest 10.0.0.1 --segments 4",
		errs: []string{"rule x: --segments needs --per-window and --window"},
	}, {
		name: "shared flags without a Redis",
		args: "--dest 10.0.0.1 --concurrency 5 --shared-key k --shared-replicas 0",
		errs: []string{
			"rule x: --shared-key needs --shared-redis",
			"rule x: --shared-replicas needs --shared-redis",
		},
	}, {
		name: "an empty Redis",
		args: "--dest 10.0.0.1 --concurrency 5 --shared-redis= --shared-key k",
		errs: []string{"rule x: --shared-redis is empty: give the URL of the Redis server that keeps the budget"},
	}, {
		name: "an empty Redis alone",
		args: "--dest 10.0.0.1 --concurrency 5 --shared-redis=",
		errs: []string{
			"rule x: --shared-redis is empty: give the URL of the Redis server that keeps the budget",
			"rule x: --shared-redis needs --shared-key",
		},
	}, {
		name: "every problem at once",
		args: "--dest 10.0.0.0/33 --port 70000 --concurrency 0 --errno EBOGUS --unit=",
		errs: []string{
			`rule x: destination "10.0.0.0/33" is not a valid CIDR: prefix length out of range`,
			"rule x: --port 70000 is outside 1..65535; leave it out for any port",
			"rule x: --unit is empty; leave it out for the whole host",
			"rule x: concurrency must be at least 1",
			`rule x: errno "EBOGUS" is not one a refusal may use: EACCES, EAGAIN, ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, ENOBUFS, EPERM, ETIMEDOUT`,
		},
	}, {
		name: "the adaptive options are checked together",
		args: "--dest 10.0.0.1 --adaptive --min 30 --samples fast",
		errs: []string{
			"rule x: adaptive: Initial 20 (default) must lie between Minimum 30 and Maximum 200 (default)",
			`rule x: adaptive.samples "fast" is not connect or request`,
		},
	}, {
		name: "empty samples",
		args: "--dest 10.0.0.1 --adaptive --samples=",
		errs: []string{"rule x: --samples is empty; leave it out for request"},
	}, {
		// As --burst needs --per-second: limit set replaces a rule whole,
		// so a tuning flag alone would make a new adaptive limit.
		name: "a tuning flag without --adaptive",
		args: "--dest 127.0.0.1 --port 1 --max 50",
		errs: []string{"rule x: --max needs --adaptive"},
	}, {
		name: "tuning flags without --adaptive",
		args: "--dest 127.0.0.1 --min 3 --initial 5 --samples=",
		errs: []string{
			"rule x: --samples is empty; leave it out for request",
			"rule x: --min needs --adaptive",
			"rule x: --initial needs --adaptive",
			"rule x: --samples needs --adaptive",
		},
	}, {
		name: "a tuning flag beside another limit",
		args: "--dest 10.0.0.1 --min 3 --concurrency 2",
		errs: []string{"rule x: --min needs --adaptive"},
	}, {
		name: "adaptive false is not overridden",
		args: "--dest 10.0.0.1 --adaptive=false --concurrency 5 --min 5",
		errs: []string{"rule x: --min tunes an adaptive limit, and --adaptive=false is given"},
	}, {
		name: "adaptive false with another limit",
		args: "--dest 10.0.0.1 --adaptive=false --concurrency 5",
		want: "name: x\ndestination: 10.0.0.1\nconcurrency: 5\n",
	}, {
		name: "probe-every 0 is the reference loop",
		args: "--dest 10.0.0.1 --adaptive --probe-every 0 --samples connect",
		want: "name: x\ndestination: 10.0.0.1\nadaptive: {probeEvery: 0, samples: connect}\n",
	}, {
		name: "the guards",
		args: "--dest 10.0.0.1 --adaptive --max-healthy 250ms --baseline 5ms",
		want: "name: x\ndestination: 10.0.0.1\nadaptive: {maxHealthy: 250ms, baseline: 5ms}\n",
	}, {
		name: "a fixed baseline has no probes to tune",
		args: "--dest 10.0.0.1 --adaptive --baseline 5ms --probe-every 10",
		errs: []string{
			"rule x: adaptive: ProbeEvery 10 with a fixed Baseline: probes learn a baseline, and this one is given",
		},
	}, {
		name: "negative probe-every",
		args: "--dest 10.0.0.1 --adaptive --probe-every=-1",
		errs: []string{
			"rule x: --probe-every -1 must be at least 0 (0: no probes, the reference loop)",
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sock, sent := setDaemon(t)
			app := App()
			var out bytes.Buffer
			app.Writer = &out
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			args := append([]string{"egressd", "--socket", sock, "limit", "set"}, strings.Fields(tt.args)...)
			err := app.RunContext(ctx, append(args, "x"))
			if tt.errs != nil {
				if err == nil || err.Error() != strings.Join(tt.errs, "\n") || len(*sent) != 0 {
					t.Fatalf("error:\n%v\nwant:\n%s\nsent %q", err, strings.Join(tt.errs, "\n"), *sent)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(*sent) != 1 || (*sent)[0] != tt.want {
				t.Fatalf("sent %q, want %q", *sent, tt.want)
			}
			// The daemon reads it as a policy file's rule.
			if _, err := policy.Parse([]byte("rules:\n  - " + strings.ReplaceAll(strings.TrimSuffix(tt.want, "\n"), "\n", "\n    ") + "\n")); err != nil {
				t.Errorf("the rule sent does not parse: %v", err)
			}
		})
	}
}

// TestPrintLoop: limit get says where an adaptive rule's baseline comes
// from, and whether a drain probe runs, when the last ended and when the
// next is due.
func TestPrintLoop(t *testing.T) {
	now := time.Date(2026, time.January, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		l    control.Limit
		want string
	}{{
		name: "probing",
		l:    control.Limit{Limit: 31, SettledLimit: 62, Probing: true, BaselineSeconds: 0.0047, BaselineSource: "probes", Probes: 7},
		want: "baseline: 4.7ms (learned in drain probes)\nprobe: running, the limit held at 31; it restores 62\n",
	}, {
		name: "between probes",
		l: control.Limit{Limit: 62, SettledLimit: 62, BaselineSeconds: 0.0047, BaselineSource: "probes", Probes: 7,
			LastProbe: now.Add(-1500 * time.Millisecond), NextProbe: now.Add(250 * time.Millisecond)},
		want: "baseline: 4.7ms (learned in drain probes)\nprobes: 7, the last ended 1.5s ago; the next is due in 250ms\n",
	}, {
		name: "the reference loop",
		l:    control.Limit{Limit: 200, SettledLimit: 200, BaselineSeconds: 0.02, BaselineSource: "window", NoProbes: true},
		want: "baseline: 20ms (10th percentile of the last five minutes)\nprobes: none (probeEvery 0: the reference loop)\n",
	}, {
		// Probes on, but every round so far decreased: the same figures
		// as the reference loop's, which only NoProbes tells apart.
		name: "probes, none yet",
		l:    control.Limit{Limit: 18, SettledLimit: 18, BaselineSeconds: 0.02, BaselineSource: "window"},
		want: "baseline: 20ms (10th percentile of the last five minutes)\nprobes: none yet; the first is planned once a round keeps its limit\n",
	}, {
		name: "the first probe due",
		l:    control.Limit{Limit: 40, SettledLimit: 40, BaselineSeconds: 0.02, BaselineSource: "window", NextProbe: now.Add(90 * time.Second)},
		want: "baseline: 20ms (10th percentile of the last five minutes)\nprobes: none yet; the first is due in 1m30s\n",
	}, {
		name: "before a baseline",
		l:    control.Limit{Limit: 20, SettledLimit: 20},
		want: "baseline: none yet (the limit holds until there is one)\nprobes: none yet; the first is planned once a round keeps its limit\n",
	}, {
		name: "fixed",
		l:    control.Limit{Limit: 20, SettledLimit: 20, BaselineSeconds: 0.005, BaselineSource: "fixed", NoProbes: true},
		want: "baseline: 5ms (fixed)\n",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			printLoop(&b, tt.l, now)
			if b.String() != tt.want {
				t.Errorf("printed:\n%s\nwant:\n%s", b.String(), tt.want)
			}
		})
	}
}

// TestLimitList: limit ls sends its filters, and prints what the daemon
// streams as a table, or with --json as the JSON array it printed whole.
func TestLimitList(t *testing.T) {
	limits := []control.Limit{
		{Name: "pay-eu", Shape: "concurrency", Limit: 5, Live: 2, Admitted: 9, Refused: 1, Source: "policy", Destinations: []string{"10.1.0.0/16"}},
		{Name: "pay-us", Shape: "adaptive", Limit: 4, Source: "cli", Pending: "host name not resolved", Destinations: []string{}},
	}
	sock, asked := fakeDaemon(t, limits)
	code, out, errOut := runCLI("--socket", sock, "limit", "ls", "--state", "installed", "--shape", "per_second", "--name", "pay-*",
		"--dest", "10.0.0.0/8", "--source", "cli", "--sort", "busy", "--rows", "20")
	if code != 0 {
		t.Fatalf("limit ls: status %d: %s", code, errOut)
	}
	want := control.LimitsQuery{State: "installed", Shape: "per_second", Name: "pay-*", Dest: "10.0.0.0/8", Source: "cli", Sort: "busy", Max: 20}
	if len(*asked) != 1 || (*asked)[0] != want {
		t.Errorf("limit ls asked %+v, want %+v", *asked, want)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "NAME") || !strings.HasPrefix(lines[1], "pay-eu ") ||
		!strings.Contains(lines[2], "pending: host name not resolved") {
		t.Errorf("limit ls printed:\n%s", out)
	}
	code, out, errOut = runCLI("--socket", sock, "--json", "limit", "ls")
	if code != 0 {
		t.Fatalf("limit ls --json: status %d: %s", code, errOut)
	}
	whole, err := json.MarshalIndent(limits, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if out != string(whole)+"\n" {
		t.Errorf("limit ls --json printed\n%s\nwant\n%s", out, whole)
	}
	if (*asked)[1] != (control.LimitsQuery{Sort: control.SortName}) {
		t.Errorf("limit ls without flags asked %+v", (*asked)[1])
	}
	empty, _ := fakeDaemon(t, nil)
	if _, out, _ := runCLI("--socket", empty, "--json", "limit", "ls"); out != "[]\n" {
		t.Errorf("limit ls --json of no rules printed %q", out)
	}
	if code, _, errOut := runCLI("--socket", sock, "limit", "ls", "--rows", "-1"); code != exitUsage {
		t.Errorf("limit ls --rows -1: status %d (%s), want %d", code, errOut, exitUsage)
	}
}
