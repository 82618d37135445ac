package controlserver

import (
	"slices"
	"testing"
)

func TestPermit(t *testing.T) {
	rootDaemon := accessPolicy{self: 0}
	withGroup := accessPolicy{self: 0, group: 4242, hasGroup: true}
	ownUID := accessPolicy{self: 998, group: 4242, hasGroup: true}
	tests := []struct {
		name   string
		peer   Peer
		policy accessPolicy
		want   Access
	}{
		{"root", Peer{UID: 0, GID: 0}, rootDaemon, AccessWrite},
		{"root with odd gid", Peer{UID: 0, GID: 1234}, withGroup, AccessWrite},
		{"daemon's own uid", Peer{UID: 998, GID: 998}, ownUID, AccessWrite},
		{"other user", Peer{UID: 1000, GID: 1000}, rootDaemon, AccessRead},
		{"other user, group set", Peer{UID: 1000, GID: 1000, Groups: []uint32{27, 100}}, withGroup, AccessRead},
		{"primary group member", Peer{UID: 1000, GID: 4242}, withGroup, AccessWrite},
		{"supplementary group member", Peer{UID: 1000, GID: 1000, Groups: []uint32{27, 4242}}, withGroup, AccessWrite},
		{"groups unknown", Peer{UID: 1000, GID: 1000, Groups: nil}, withGroup, AccessRead},
		// Without a configured group, gid 0 (the zero value) grants nothing.
		{"root group, no group configured", Peer{UID: 1000, GID: 0, Groups: []uint32{0}}, rootDaemon, AccessRead},
		{"nobody", Peer{UID: 65534, GID: 65534}, ownUID, AccessRead},
		{"overflow uid", Peer{UID: 1<<32 - 1, GID: 1<<32 - 1}, withGroup, AccessRead},
	}
	for _, tt := range tests {
		if got := permit(tt.peer, tt.policy); got != tt.want {
			t.Errorf("%s: permit(%+v, %+v) = %v, want %v", tt.name, tt.peer, tt.policy, got, tt.want)
		}
	}
}

func TestParseStatusGroups(t *testing.T) {
	tests := []struct {
		name    string
		status  string
		want    []uint32
		wantErr bool
	}{
		{"several", "Name:\tbash\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 27 4242 \nNgid:\t0\n", []uint32{4, 24, 27, 4242}, false},
		{"none", "Name:\tx\nGroups:\t\nNgid:\t0\n", []uint32{}, false},
		{"none, no tab", "Groups:\n", []uint32{}, false},
		{"max gid", "Groups:\t4294967295\n", []uint32{4294967295}, false},
		{"missing", "Name:\tx\n", nil, true},
		{"garbage", "Groups:\t1 two 3\n", nil, true},
		{"negative", "Groups:\t-1\n", nil, true},
		{"too big", "Groups:\t4294967296\n", nil, true},
	}
	for _, tt := range tests {
		got, err := parseStatusGroups([]byte(tt.status))
		if (err != nil) != tt.wantErr || !slices.Equal(got, tt.want) || (err == nil && got == nil) {
			t.Errorf("%s: got %v, %v; want %v, error %v", tt.name, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestAccessString(t *testing.T) {
	for a, want := range map[Access]string{AccessNone: "none", AccessRead: "read", AccessWrite: "write", 7: "Access(7)"} {
		if got := a.String(); got != want {
			t.Errorf("%d: %q, want %q", a, got, want)
		}
	}
}
