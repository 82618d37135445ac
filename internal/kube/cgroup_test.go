package kube

import (
	"errors"
	"testing"
)

func TestPodCgroup(t *testing.T) {
	const uid = "0fe7c4d6-3c1b-4b6e-9d7a-2f1f0c1a9e55"
	const esc = "0fe7c4d6_3c1b_4b6e_9d7a_2f1f0c1a9e55"
	for _, tc := range []struct {
		driver Driver
		root   string
		qos    QoS
		want   string
	}{
		{Cgroupfs, "", Guaranteed, "kubepods/pod" + uid},
		{Cgroupfs, "/", Burstable, "kubepods/burstable/pod" + uid},
		{Cgroupfs, "/", BestEffort, "kubepods/besteffort/pod" + uid},
		{Cgroupfs, "/custom/root", Burstable, "custom/root/kubepods/burstable/pod" + uid},
		{Systemd, "/", Guaranteed, "kubepods.slice/kubepods-pod" + esc + ".slice"},
		{Systemd, "", Burstable, "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + esc + ".slice"},
		{Systemd, "/", BestEffort, "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + esc + ".slice"},
		{Systemd, "/my-root", Guaranteed, "my_root.slice/my_root-kubepods.slice/my_root-kubepods-pod" + esc + ".slice"},
		{Systemd, "/node.slice", Burstable, "node.slice/node-kubepods.slice/node-kubepods-burstable.slice/node-kubepods-burstable-pod" + esc + ".slice"},
	} {
		got, err := PodCgroup(tc.driver, tc.root, tc.qos, uid)
		if err != nil || got != tc.want {
			t.Errorf("PodCgroup(%s, %q, %s) = %q, %v; want %q", tc.driver, tc.root, tc.qos, got, err, tc.want)
		}
	}
	for _, bad := range []struct {
		driver Driver
		root   string
		qos    QoS
		uid    string
	}{
		{"runc", "/", Burstable, uid},
		{Systemd, "/", "Platinum", uid},
		{Cgroupfs, "/", Burstable, ""},
		{Cgroupfs, "/", Burstable, "../escape"},
		{Cgroupfs, "/a/../b", Burstable, uid},
		{Systemd, "/./kubelet.slice", Burstable, uid},
	} {
		if got, err := PodCgroup(bad.driver, bad.root, bad.qos, bad.uid); !errors.Is(err, ErrLayout) {
			t.Errorf("PodCgroup(%s, %q, %s, %q) = %q, %v; want ErrLayout", bad.driver, bad.root, bad.qos, bad.uid, got, err)
		}
	}
}
