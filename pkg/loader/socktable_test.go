//go:build linux

package loader

import (
	"maps"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/privtest"
)

// roundTrip sends a byte on c and reads the echo.
func roundTrip(t *testing.T, c *fdCloser) {
	t.Helper()
	b := []byte{'x'}
	if _, err := unix.Write(c.fd, b); err != nil {
		t.Fatalf("write: %v", err)
	}
	if n, err := unix.Read(c.fd, b); n != 1 || err != nil {
		t.Fatalf("read: %d, %v", n, err)
	}
}

// heldEntries maps each held entry of the socket table to its socket's
// cookie.
func heldEntries(t *testing.T, d *Datapath) map[uint32]uint64 {
	t.Helper()
	held := map[uint32]uint64{}
	var k uint32
	var ss egressdSockState
	it := d.maps().SockTable.Iterate()
	for it.Next(&k, &ss) {
		if ss.Word&3 != 0 {
			held[k] = ss.Word >> 2
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return held
}

// moveEntry moves the socket table's entry from to to, leaving from
// empty: a socket's state where another build, or a program that sets
// its mark, would have it.
func moveEntry(t *testing.T, d *Datapath, from, to uint32) {
	t.Helper()
	table := d.maps().SockTable
	var ss egressdSockState
	if err := table.Lookup(from, &ss); err != nil {
		t.Fatal(err)
	}
	if err := table.Put(to, &ss); err != nil {
		t.Fatal(err)
	}
	if err := table.Put(from, &egressdSockState{}); err != nil {
		t.Fatal(err)
	}
}

func cookieOf(t *testing.T, c *fdCloser) uint64 {
	t.Helper()
	cookie, err := unix.GetsockoptUint64(c.fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}
	return cookie
}

// TestSocketStatePlaces: a socket takes the entry its cookie picks in the
// socket table's hot part, else the one it picks in the whole table, else
// socket storage; every program finds each socket's state wherever it is
// (the requests on each counted, the recount sees all, every slot comes
// back). An 8-entry table has a hot part of 4: sockets connect until
// both parts are full and some are in storage.
func TestSocketStatePlaces(t *testing.T) {
	const size = 8
	d, cg := openSockTable(t, size)
	hot := uint64(hotEntries(size))
	if hot != 4 {
		t.Fatalf("hot part of %d entries: %d", size, hot)
	}
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	storageBefore, err := d.StorageSockets()
	if err != nil {
		t.Fatal(err)
	}
	privtest.Join(t, cg)
	var conns []*fdCloser
	want := map[uint32]uint64{} // the places, as the kernel should pick them
	wantStorage := uint64(0)
	// Which entries a socket's cookie picks depends on where the
	// kernel's cookies stand: connect until every kind of place is taken.
	for len(want) < size || wantStorage < 8 {
		if len(conns) == 1000 {
			t.Fatalf("1,000 sockets and the table not full (%d held) or fewer than 8 in storage (%d)", len(want), wantStorage)
		}
		c := dial(t, srv).(*fdCloser)
		conns = append(conns, c)
		cookie := cookieOf(t, c)
		near, far := uint32(cookie%hot), uint32(cookie%size)
		if _, held := want[near]; !held {
			want[near] = cookie
		} else if _, held := want[far]; !held {
			want[far] = cookie
		} else {
			wantStorage++
		}
	}
	for _, c := range conns {
		roundTrip(t, c)
	}
	storageAfter, err := d.StorageSockets()
	if err != nil {
		t.Fatal(err)
	}
	if held := heldEntries(t, d); !maps.Equal(held, want) || storageAfter-storageBefore != wantStorage {
		t.Errorf("table entries held %v and %d storages, want %v and %d", held, storageAfter-storageBefore, want, wantStorage)
	}
	s := stats(t, d, "r")
	n := len(conns)
	if s.Live != int64(n) || s.Requests != uint64(n) || s.Responses != uint64(n) || s.InFlight != 0 {
		t.Errorf("live %d, requests %d, responses %d, in flight %d; want %d, %d, %d, 0", s.Live, s.Requests, s.Responses, s.InFlight, n, n, n)
	}
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if r := rc["r"]; r.Counted != int64(n) || r.Drift() != 0 {
		t.Errorf("recount %+v (drift %d), want %d counted", r, r.Drift(), n)
	}
	for _, c := range conns {
		c.Close()
	}
	s = waitLive(t, d, "r", 0)
	if s.Released != uint64(n) {
		t.Errorf("released %d, want %d", s.Released, n)
	}
	if held := heldEntries(t, d); len(held) != 0 {
		t.Errorf("after close, entries still held: %v", held)
	}
}

// TestSocketStateOfBuildBefore: a build before the hot part put every
// socket in the entry its cookie picks in the whole table, unmarked. A
// socket whose state is there is still found: its requests count and its
// slot comes back at close.
func TestSocketStateOfBuildBefore(t *testing.T) {
	const size = 8 // a hot part of 4
	d, cg := openSockTable(t, size)
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	privtest.Join(t, cg)
	// A socket whose cookie picks different entries in the hot part and
	// in the whole table, alone on the rule: cookies count up, so one in
	// four consecutive ones does; the others are closed again.
	var c *fdCloser
	var cookie uint64
	for range 100 {
		c = dial(t, srv).(*fdCloser)
		if cookie = cookieOf(t, c); cookie%size >= uint64(hotEntries(size)) {
			break
		}
		c.Close()
		c = nil
	}
	if c == nil {
		t.Fatal("100 sockets in a row with cookies that pick the same entry in both parts")
	}
	roundTrip(t, c)

	// Move its state where the build before put it.
	hot, far := uint32(cookie%uint64(hotEntries(size))), uint32(cookie%size)
	var ss egressdSockState
	if err := d.maps().SockTable.Lookup(hot, &ss); err != nil || ss.Word != cookie<<2|1 {
		t.Fatalf("hot entry %d: word %#x (%v), want the socket's (cookie %d) held", hot, ss.Word, err, cookie)
	}
	moveEntry(t, d, hot, far)

	roundTrip(t, c)
	before := stats(t, d, "r")
	if before.Requests != 2 || before.Responses != 2 || before.InFlight != 0 || before.Live != 1 {
		t.Errorf("requests %d, responses %d, in flight %d, live %d; want 2, 2, 0, 1", before.Requests, before.Responses, before.InFlight, before.Live)
	}
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if r := rc["r"]; r.Counted != 1 || r.Drift() != 0 {
		t.Errorf("recount %+v (drift %d), want the socket counted", r, r.Drift())
	}
	c.Close()
	if s := waitLive(t, d, "r", 0); s.Released != before.Released+1 {
		t.Errorf("released %d, want %d", s.Released, before.Released+1)
	}
	if err := d.maps().SockTable.Lookup(far, &ss); err != nil || ss.Word != cookie<<2 {
		t.Errorf("entry %d after close: word %#x (%v), want the socket's released", far, ss.Word, err)
	}
}

// TestSocketStateMarkedByAnother: another program may add RETRANS_CB,
// egressd's mark of a socket outside the table's hot part, to a socket in
// it. That socket's state is still found (in the hot part last): its
// requests count, the recount sees it and its slot comes back.
func TestSocketStateMarkedByAnother(t *testing.T) {
	const size = 8
	d, cg := openSockTable(t, size)
	hot := uint64(hotEntries(size))
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	privtest.Join(t, cg)
	// A socket egressd marked: in the rest of the table, beyond the hot
	// part, its hot entry held by another.
	open := map[uint64]*fdCloser{}
	var c *fdCloser
	var cookie uint64
	for range 100 {
		x := dial(t, srv).(*fdCloser)
		k := cookieOf(t, x)
		open[k] = x
		if k%size >= hot && heldEntries(t, d)[uint32(k%size)] == k {
			c, cookie = x, k
			break
		}
	}
	if c == nil {
		t.Fatal("100 sockets and none beyond the hot part")
	}
	near, far := uint32(cookie%hot), uint32(cookie%size)
	other, ok := heldEntries(t, d)[near]
	if !ok {
		t.Fatalf("hot entry %d of a socket beyond it is not held", near)
	}
	open[other].Close()
	delete(open, other)
	// Now in the hot part, still marked.
	moveEntry(t, d, far, near)

	before := stats(t, d, "r")
	roundTrip(t, c)
	if s := stats(t, d, "r"); s.Requests != before.Requests+1 || s.Responses != before.Responses+1 || s.InFlight != 0 {
		t.Errorf("requests %d, responses %d, in flight %d; want %d, %d, 0", s.Requests, s.Responses, s.InFlight, before.Requests+1, before.Responses+1)
	}
	rc, err := d.Recount()
	if err != nil {
		t.Fatal(err)
	}
	if r := rc["r"]; r.Counted != int64(len(open)) || r.Drift() != 0 {
		t.Errorf("recount %+v (drift %d), want the %d sockets open counted", r, r.Drift(), len(open))
	}
	c.Close()
	if s := waitLive(t, d, "r", int64(len(open)-1)); s.Released != before.Released+1 {
		t.Errorf("released %d, want %d", s.Released, before.Released+1)
	}
	var ss egressdSockState
	if err := d.maps().SockTable.Lookup(near, &ss); err != nil || ss.Word != cookie<<2 {
		t.Errorf("entry %d after close: word %#x (%v), want the socket's released", near, ss.Word, err)
	}
}
