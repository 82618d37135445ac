package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// Resource is the EgressLimit custom resource (deploy/kubernetes/crd.yaml).
var Resource = schema.GroupVersionResource{Group: "egressd.io", Version: "v1alpha1", Resource: "egresslimits"}

// Config is how the daemon reaches the API server and finds pods' cgroups.
type Config struct {
	// Node is this node's name: the pods bound to it are watched.
	Node string
	// Kubeconfig is a kubeconfig file; empty is the pod's service account
	// (in-cluster).
	Kubeconfig string
	// Layout is the kubelet's cgroup driver and root.
	Layout Layout
	// CgroupMount is the cgroup2 mount, where pods' cgroups are watched
	// appearing and going.
	CgroupMount string
	Logger      *slog.Logger
}

// Sink is where the rules go: the daemon's table.
type Sink interface {
	// Apply makes rules the node's Kubernetes rules, whole or not at
	// all, and says which limits were left out (by source) and why.
	Apply(ctx context.Context, rules []Rule) (refused map[string]string, err error)
	// Refused is the limits left out now, and changed has a value when a
	// change of the node's own rules (a reload) left out others.
	Refused() (refused map[string]string, changed <-chan struct{})
	// Rescan looks the rules' cgroups up again: a pod's appeared or went.
	Rescan(ctx context.Context)
}

// Status is what the source says of itself in egressd status.
type Status struct {
	Node      string
	Connected bool
	// Since is when Connected last changed; Error why it is false.
	Since   time.Time
	Error   string
	Limits  int // the EgressLimits that select pods of this node
	Refused int // of which those not applied
	Pods    int // the pods bound to this node
	Rules   int // the rules they make
}

// Source watches this node's pods and the EgressLimits and keeps the
// sink's rules what they make. When the API server cannot be reached the
// sink keeps the rules last applied (fail-static) while the watches retry
// with client-go's backoff (0.8 s doubling to 30 s, with up to as much
// again of jitter).
type Source struct {
	cfg      Config
	client   kubernetes.Interface
	dyn      dynamic.Interface
	recorder record.EventRecorder
	events   record.EventBroadcaster
	log      *slog.Logger

	kick chan struct{}

	mu     sync.Mutex
	status Status
	// told is the problem last reported on each limit (by UID and
	// generation), so that one is reported once per node.
	told map[string]string
}

// New connects nothing yet: Run does.
func New(cfg Config) (*Source, error) {
	if cfg.Node == "" {
		return nil, errors.New("kubernetes: no node name")
	}
	if _, err := PodCgroup(cfg.Layout.Driver, cfg.Layout.Root, Burstable, "x"); err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig == "" {
		rc, err = rest.InClusterConfig()
	} else {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes config: %w", err)
	}
	rc.UserAgent = "egressd/" + cfg.Node
	s := &Source{cfg: cfg, kick: make(chan struct{}, 1), told: map[string]string{},
		status: Status{Node: cfg.Node, Since: time.Now(), Error: "not synced yet"}}
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return reachTransport{rt, s} })
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "kubernetes")
	// client-go logs through klog: its lines go where the daemon's do.
	klog.SetSlogLogger(log)
	s.client, s.dyn, s.log, s.events = client, dyn, log, record.NewBroadcaster()
	s.recorder = s.events.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "egressd", Host: cfg.Node})
	return s, nil
}

// Status is the source's state now.
func (s *Source) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status
}

// Run keeps sink's rules those of the pods and limits until ctx ends.
func (s *Source) Run(ctx context.Context, sink Sink) error {
	s.events.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: s.client.CoreV1().Events("")})
	defer s.events.Shutdown()
	podFactory := informers.NewSharedInformerFactoryWithOptions(s.client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", s.cfg.Node).String()
	}))
	pods := podFactory.Core().V1().Pods()
	limitFactory := dynamicinformer.NewDynamicSharedInformerFactory(s.dyn, 0)
	limits := limitFactory.ForResource(Resource)
	kick := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.poke(s.kick) },
		UpdateFunc: func(any, any) { s.poke(s.kick) },
		DeleteFunc: func(any) { s.poke(s.kick) },
	}
	for _, inf := range []cache.SharedIndexInformer{pods.Informer(), limits.Informer()} {
		if _, err := inf.AddEventHandler(kick); err != nil {
			return err
		}
	}
	podFactory.Start(ctx.Done())
	limitFactory.Start(ctx.Done())
	defer podFactory.Shutdown()
	defer limitFactory.Shutdown()

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { s.watchCgroups(ctx, sink) })

	// Until the first lists arrive the sink keeps what it had: the rules
	// saved at the last run, enforced across the restart.
	if !cache.WaitForCacheSync(ctx.Done(), pods.Informer().HasSynced, limits.Informer().HasSynced) {
		return nil
	}
	s.log.Info("watching pods and EgressLimits", "node", s.cfg.Node)
	_, refusedChanged := sink.Refused()
	var last []Rule
	applied := false
	// Limits are read again only when they change: pods' status changes
	// wake this loop far more often.
	parsed := map[string]Limit{}
	for {
		var retry <-chan time.Time
		ls, err := limits.Lister().List(labels.Everything())
		if err != nil {
			return err
		}
		ps, err := pods.Lister().List(labels.Everything())
		if err != nil {
			return err
		}
		read := make([]Limit, len(ls))
		next := make(map[string]Limit, len(ls))
		for i, o := range ls {
			u := o.(*unstructured.Unstructured)
			key := string(u.GetUID()) + "/" + u.GetResourceVersion()
			l, ok := parsed[key]
			if !ok {
				l = ReadLimit(u)
			}
			read[i], next[key] = l, l
		}
		parsed = next
		rules, err := Rules(read, ps, s.cfg.Layout)
		if err != nil {
			s.log.Error("pods left out", "err", err)
		}
		var refused map[string]string
		if !applied || !slices.EqualFunc(rules, last, func(a, b Rule) bool { return a == b }) {
			if refused, err = sink.Apply(ctx, rules); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				s.log.Error("applying the EgressLimits' rules; trying again in a second", "err", err)
				retry = time.After(time.Second)
			} else {
				last, applied = rules, true
			}
		}
		if refused == nil {
			refused, _ = sink.Refused()
		}
		s.report(ls, read, refused, ps, len(rules))
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
		case <-refusedChanged:
		case <-retry:
		}
	}
}

func (s *Source) poke(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// report tells each limit that selects pods here and has a problem, once
// per change of it, with an Event naming this node, and updates the
// status: a thousand nodes do not each report a limit for pods they do not
// run.
func (s *Source) report(objs []runtime.Object, read []Limit, refused map[string]string, pods []*corev1.Pod, rules int) {
	told := map[string]string{}
	n := 0
	limits := 0
	for i, l := range read {
		if !selectsHere(l, pods) {
			continue // another node's to report on
		}
		limits++
		o := objs[i].(*unstructured.Unstructured)
		problem := l.Problem
		if problem == "" {
			problem = refused[l.Source()]
		}
		if problem == "" {
			continue
		}
		n++
		key := fmt.Sprintf("%s/%d", o.GetUID(), o.GetGeneration())
		told[key] = problem
		if s.told[key] != problem {
			s.recorder.Eventf(o, corev1.EventTypeWarning, "NotApplied", "node %s: %s", s.cfg.Node, problem)
			s.log.Warn("EgressLimit not applied", "limit", l.Namespace+"/"+l.Name, "problem", problem)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.told = told
	s.status.Limits, s.status.Refused, s.status.Pods, s.status.Rules = limits, n, len(pods), rules
}

func (s *Source) setConnected(ok bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.status.Connected != ok {
		s.status.Since = time.Now()
		if ok {
			s.log.Info("API server reached")
		} else {
			s.log.Warn("API server lost; enforcing the rules last known", "err", err)
		}
	}
	s.status.Connected, s.status.Error = ok, ""
	if err != nil {
		s.status.Error = err.Error()
	}
}

// reachTransport marks the source connected or not by what each request
// to the API server meets, its watches' and lists' as they retry, so
// that the status follows the server without requests of its own.
type reachTransport struct {
	next http.RoundTripper
	s    *Source
}

func (t reachTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(req)
	switch {
	case err != nil && req.Context().Err() == nil:
		t.s.setConnected(false, err)
	case err == nil && resp.StatusCode >= 500:
		t.s.setConnected(false, fmt.Errorf("%s %s: %s", req.Method, req.URL.Path, resp.Status))
	case err == nil:
		t.s.setConnected(true, nil)
	}
	return resp, err
}

// watchCgroups rescans the sink's cgroups when a pod's cgroup appears or
// goes in one of the kubelet's QoS directories, so that a pod is
// enforced, or forgotten, within moments of its cgroup changing. A QoS
// directory that does not exist yet is looked for again every second;
// without inotify, the cgroups are looked up every second.
func (s *Source) watchCgroups(ctx context.Context, sink Sink) {
	var dirs []string
	for _, q := range []QoS{Guaranteed, Burstable, BestEffort} {
		p, _ := PodCgroup(s.cfg.Layout.Driver, s.cfg.Layout.Root, q, "x")
		dirs = append(dirs, filepath.Join(s.cfg.CgroupMount, filepath.FromSlash(path.Dir(p))))
	}
	changed := make(chan struct{}, 1)
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		fd = -1
		s.log.Error("watching pods' cgroups; they are looked up every second instead", "err", err)
	} else {
		f := os.NewFile(uintptr(fd), "inotify")
		var wg sync.WaitGroup
		defer wg.Wait()
		defer f.Close() // before the wait: it ends the read
		wg.Go(func() {
			buf := make([]byte, 64*1024)
			for {
				if _, err := f.Read(buf); err != nil {
					return
				}
				s.poke(changed)
			}
		})
	}
	watched := map[string]bool{}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		for _, d := range dirs {
			if fd < 0 || watched[d] {
				continue
			}
			if _, err := unix.InotifyAddWatch(fd, d, unix.IN_CREATE|unix.IN_DELETE|unix.IN_ONLYDIR); err == nil {
				watched[d] = true
				s.poke(changed) // pods may have come before the watch
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
			sink.Rescan(ctx)
		case <-tick.C:
			if fd < 0 {
				sink.Rescan(ctx)
			}
		}
	}
}
