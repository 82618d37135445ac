// Package kube maps Kubernetes pods on this node to what the datapath
// scopes rules by: their cgroups.
package kube

import (
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
)

// Driver is the kubelet's cgroup driver (its --cgroup-driver).
type Driver string

const (
	Systemd  Driver = "systemd"
	Cgroupfs Driver = "cgroupfs"
)

// QoS is a pod's quality of service class (status.qosClass).
type QoS string

const (
	Guaranteed QoS = "Guaranteed"
	Burstable  QoS = "Burstable"
	BestEffort QoS = "BestEffort"
)

// ErrLayout is the error for a pod whose cgroup cannot be named.
var ErrLayout = errors.New("pod cgroup")

// PodCgroup is the cgroup, relative to the cgroup2 mount, the kubelet
// makes for pod uid of class qos with driver and its --cgroup-root (""
// or "/" for the default). The kubelet names it after the pod's class:
// kubepods/pod<uid> for Guaranteed, kubepods/<class>/pod<uid> for the
// others; the systemd driver spells each level as a slice named after
// the levels above it, a '-' in a name turned into '_'.
func PodCgroup(driver Driver, root string, qos QoS, uid string) (string, error) {
	if uid == "" || strings.ContainsAny(uid, "/.") {
		return "", fmt.Errorf("%w: uid %q", ErrLayout, uid)
	}
	levels := strings.FieldsFunc(root, func(r rune) bool { return r == '/' })
	if slices.ContainsFunc(levels, func(l string) bool { return l == "." || l == ".." }) {
		return "", fmt.Errorf("%w: cgroup root %q", ErrLayout, root)
	}
	levels = append(levels, "kubepods")
	switch qos {
	case Guaranteed:
	case Burstable, BestEffort:
		levels = append(levels, strings.ToLower(string(qos)))
	default:
		return "", fmt.Errorf("%w: QoS class %q", ErrLayout, qos)
	}
	levels = append(levels, "pod"+uid)
	switch driver {
	case Cgroupfs:
		return path.Join(levels...), nil
	case Systemd:
		// Each slice's name is its parents' and its own, joined by '-'.
		var slices []string
		name := ""
		for _, l := range levels {
			if base, ok := strings.CutSuffix(l, ".slice"); ok {
				// A slice of the root given as such: its own part.
				l = base[strings.LastIndexByte(base, '-')+1:]
			} else {
				l = strings.ReplaceAll(l, "-", "_")
			}
			if name != "" {
				name += "-"
			}
			name += l
			slices = append(slices, name+".slice")
		}
		return path.Join(slices...), nil
	default:
		return "", fmt.Errorf("%w: cgroup driver %q", ErrLayout, driver)
	}
}
