//go:build linux

package loader

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// program is one BPF program and where it attaches.
type program struct {
	name   string
	attach ebpf.AttachType
	prog   func(*egressdObjects) *ebpf.Program
}

// Release paths attach before admission, so no slot is ever taken that
// could not be given back; ingress before egress, so no request is armed
// that could not be disarmed.
var (
	connPrograms = []program{
		{"sock_release", ebpf.AttachCgroupInetSockRelease, func(o *egressdObjects) *ebpf.Program { return o.EgressdSockRelease }},
		{"sockops", ebpf.AttachCGroupSockOps, func(o *egressdObjects) *ebpf.Program { return o.EgressdSockops }},
		{"connect4", ebpf.AttachCGroupInet4Connect, func(o *egressdObjects) *ebpf.Program { return o.EgressdConnect4 }},
		{"connect6", ebpf.AttachCGroupInet6Connect, func(o *egressdObjects) *ebpf.Program { return o.EgressdConnect6 }},
	}
	requestPrograms = []program{
		{"ingress", ebpf.AttachCGroupInetIngress, func(o *egressdObjects) *ebpf.Program { return o.EgressdIngress }},
		{"egress", ebpf.AttachCGroupInetEgress, func(o *egressdObjects) *ebpf.Program { return o.EgressdEgress }},
	}
	udpPrograms = []program{
		{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, func(o *egressdObjects) *ebpf.Program { return o.EgressdRecvmsg4 }},
		{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, func(o *egressdObjects) *ebpf.Program { return o.EgressdRecvmsg6 }},
		{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(o *egressdObjects) *ebpf.Program { return o.EgressdSendmsg4 }},
		{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(o *egressdObjects) *ebpf.Program { return o.EgressdSendmsg6 }},
	}
	// optionalPrograms attach only while some rule needs them, as
	// uses.needs says: they run for every packet (requests), or every UDP
	// datagram sent or received with an address (UDP flows), below the
	// cgroup.
	optionalPrograms = [optionalLen][]program{requestPrograms, udpPrograms}
	// allPrograms are every program that attaches to the cgroup.
	allPrograms = slices.Concat(connPrograms, requestPrograms, udpPrograms)
)

// attachAll attaches each program, or points an existing pinned link at
// this build's program, which swaps it atomically.
func (d *Datapath) attachAll(progs []program) error {
	for _, p := range progs {
		if _, ok := d.links[p.name]; ok {
			continue
		}
		path := filepath.Join(d.linksDir(), p.name)
		l, err := link.LoadPinnedLink(path, nil)
		switch {
		case err == nil:
			if err := d.adoptLink(l, p); err != nil {
				l.Close()
				return err
			}
		case errors.Is(err, os.ErrNotExist):
			l, err = link.AttachCgroup(link.CgroupOptions{Path: d.cfg.Cgroup, Attach: p.attach, Program: p.prog(&d.objs)})
			if err != nil {
				return fmt.Errorf("attach %s: %w", p.name, err)
			}
			if err := l.Pin(path); err != nil {
				l.Close()
				return fmt.Errorf("pin %s: %w", p.name, err)
			}
		default:
			return fmt.Errorf("load pinned %s: %w", p.name, err)
		}
		d.links[p.name] = l
	}
	return nil
}

func (d *Datapath) adoptLink(l link.Link, p program) error {
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("pinned %s: %w", p.name, err)
	}
	if cg := info.Cgroup(); cg == nil || cg.CgroupId != d.cgroupID {
		return fmt.Errorf("pinned %s is attached to another cgroup than %s (uninstall first)", p.name, d.cfg.Cgroup)
	}
	if err := l.Update(p.prog(&d.objs)); err != nil {
		return fmt.Errorf("update pinned %s: %w", p.name, err)
	}
	return nil
}

// detach unpins and closes programs' links; pinned ones this process has
// not opened are found through their pins when adopting.
func (d *Datapath) detach(progs []program, adopting bool) error {
	var errs []error
	for _, p := range slices.Backward(progs) {
		l, ok := d.links[p.name]
		if !ok && !adopting {
			continue
		}
		if !ok {
			// Not ours yet, but a previous run may have pinned it.
			var err error
			l, err = link.LoadPinnedLink(filepath.Join(d.linksDir(), p.name), nil)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("load pinned %s: %w", p.name, err))
				continue
			}
		}
		errs = append(errs, l.Unpin(), l.Close())
		delete(d.links, p.name)
	}
	return errors.Join(errs...)
}

// syncOptional attaches each set of optionalPrograms while need says some
// rule needs it, and detaches it otherwise.
func (d *Datapath) syncOptional(need [optionalLen]bool, adopting bool) error {
	var errs []error
	for set, progs := range optionalPrograms {
		if need[set] {
			errs = append(errs, d.attachAll(progs))
		} else {
			errs = append(errs, d.detach(progs, adopting))
		}
	}
	return errors.Join(errs...)
}
