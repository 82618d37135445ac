// Package deploy holds what operators load next to egressd: Prometheus
// recording and alerting rules (prometheus/), a Grafana dashboard
// (grafana/) and the Kubernetes manifests (kubernetes/). The manifests are
// embedded so that tests run the DaemonSet's own command line.
package deploy

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

//go:embed kubernetes/*.yaml
var manifests embed.FS

// daemonSetContainer is the DaemonSet's container that runs the daemon.
const daemonSetContainer = "egressd"

// DaemonSetArgs returns the command line of the egressd container of the
// DaemonSet in kubernetes/, command then args, with each $(VAR) expanded
// from vars as the kubelet expands it from the container's environment
// ($$ for a literal $). A $(VAR) that is not among the container's env,
// which the kubelet would leave as written, or that vars does not give,
// is an error.
func DaemonSetArgs(vars map[string]string) ([]string, error) {
	c, err := daemonSetCommand()
	if err != nil {
		return nil, err
	}
	return c.expand(vars)
}

type containerCommand struct {
	argv []string // command, then args
	env  []string // the names of its env vars
}

// expand expands argv as DaemonSetArgs says.
func (c containerCommand) expand(vars map[string]string) ([]string, error) {
	lookup := func(name string) (string, error) {
		if !slices.Contains(c.env, name) {
			return "", fmt.Errorf("$(%s) is not an env var of the container: the kubelet would pass it as written", name)
		}
		v, ok := vars[name]
		if !ok {
			return "", fmt.Errorf("$(%s): no value given", name)
		}
		return v, nil
	}
	out := make([]string, 0, len(c.argv))
	for _, arg := range c.argv {
		s, err := expand(arg, lookup)
		if err != nil {
			return nil, fmt.Errorf("daemonset: %w", err)
		}
		out = append(out, s)
	}
	return out, nil
}

// daemonSetCommand finds the one DaemonSet among the manifests and its
// egressd container.
func daemonSetCommand() (containerCommand, error) {
	type container struct {
		Name    string   `yaml:"name"`
		Command []string `yaml:"command"`
		Args    []string `yaml:"args"`
		Env     []struct {
			Name string `yaml:"name"`
		} `yaml:"env"`
	}
	type object struct {
		Kind string `yaml:"kind"`
		Spec struct {
			Template struct {
				Spec struct {
					Containers []container `yaml:"containers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	files, err := fs.Glob(manifests, "kubernetes/*.yaml")
	if err != nil {
		return containerCommand{}, err
	}
	var found []container
	for _, f := range files {
		b, err := manifests.ReadFile(f)
		if err != nil {
			return containerCommand{}, err
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		for {
			var o object
			err := dec.Decode(&o)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return containerCommand{}, fmt.Errorf("%s: %w", f, err)
			}
			if o.Kind != "DaemonSet" {
				continue
			}
			for _, c := range o.Spec.Template.Spec.Containers {
				if c.Name == daemonSetContainer {
					found = append(found, c)
				}
			}
		}
	}
	if len(found) != 1 {
		return containerCommand{}, fmt.Errorf("daemonset: %d containers named %q in the manifests, want 1", len(found), daemonSetContainer)
	}
	c := found[0]
	if len(c.Command) == 0 {
		return containerCommand{}, errors.New("daemonset: the container has no command, and the image's entrypoint is not in the manifests")
	}
	cc := containerCommand{argv: append(slices.Clone(c.Command), c.Args...)}
	for _, e := range c.Env {
		cc.env = append(cc.env, e.Name)
	}
	return cc, nil
}

// expand replaces each $(NAME) in s with lookup(NAME), reading s as the
// kubelet reads a container's command and args (Kubernetes'
// third_party/forked/golang/expansion): $$ is a literal $, and a $ that
// begins no reference, or a $( never closed, stays as written (what
// follows is read on).
func expand(s string, lookup func(name string) (string, error)) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch next := s[i+1]; {
		case next == '$':
			b.WriteByte('$')
			i++
		case next == '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString("$(")
				i++
				continue
			}
			v, err := lookup(s[i+2 : i+2+end])
			if err != nil {
				return "", err
			}
			b.WriteString(v)
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String(), nil
}
