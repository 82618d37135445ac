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

// places returns the entries a socket's cookie picks in the socket
// table's hot part, warm part and whole table, each only where it differs
// from the one before, in the order the socket tries them.
func places(cookie uint64, size int) []uint32 {
	hot, warm := tableParts(size)
	out := []uint32{uint32(cookie % uint64(hot))}
	for _, n := range []int{warm, size} {
		if e := uint32(cookie % uint64(n)); e != out[len(out)-1] {
			out = append(out, e)
		}
	}
	return out
}

// TestSocketStatePlaces: a socket takes the entry its cookie picks in the
// socket table's hot part, else the one it picks in the warm part, else in
// the whole table, else an entry of the overflow table; every program
// finds each socket's state wherever it is (the requests on each counted,
// the recount sees all, every slot comes back and the overflow table is
// empty again). An 8-entry table has a hot part of 2 and a warm part of 4:
// sockets connect until the table is full and some are in the overflow
// table.
func TestSocketStatePlaces(t *testing.T) {
	const size = 8
	d, cg := openSockTable(t, size)
	if hot, warm := tableParts(size); hot != 2 || warm != 4 {
		t.Fatalf("parts of a %d-entry table: %d and %d", size, hot, warm)
	}
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	privtest.Join(t, cg)
	var conns []*fdCloser
	want := map[uint32]uint64{} // the places, as the kernel should pick them
	wantOverflow := 0
	// Which entries a socket's cookie picks depends on where the
	// kernel's cookies stand: connect until every kind of place is taken.
	for len(want) < size || wantOverflow < 8 {
		if len(conns) == 1000 {
			t.Fatalf("1,000 sockets and the table not full (%d held) or fewer than 8 in the overflow table (%d)", len(want), wantOverflow)
		}
		c := dial(t, srv).(*fdCloser)
		conns = append(conns, c)
		cookie := cookieOf(t, c)
		placed := false
		for _, e := range places(cookie, size) {
			if _, held := want[e]; !held {
				want[e], placed = cookie, true
				break
			}
		}
		if !placed {
			wantOverflow++
		}
	}
	for _, c := range conns {
		roundTrip(t, c)
	}
	overflow, err := d.OverflowSockets()
	if err != nil {
		t.Fatal(err)
	}
	if held := heldEntries(t, d); !maps.Equal(held, want) || overflow != wantOverflow {
		t.Errorf("table entries held %v and %d in the overflow table, want %v and %d", held, overflow, want, wantOverflow)
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
	if n := overflowEntries(t, d); n != 0 {
		t.Errorf("after close, %d entries left in the overflow table", n)
	}
}

// overflowEntries counts the overflow table's entries, held or not.
func overflowEntries(t *testing.T, d *Datapath) int {
	t.Helper()
	n := 0
	var cookie uint64
	var ss egressdSockState
	it := d.maps().SockOverflow.Iterate()
	for it.Next(&cookie, &ss) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSocketStateOfBuildBefore: builds before put every socket unmarked,
// in the entry its cookie picks in the whole table, and later in the one
// it picks in the warm part (their hot part). A socket whose state is in
// either is still found: its requests count, the recount sees it and its
// slot comes back at close.
func TestSocketStateOfBuildBefore(t *testing.T) {
	const size = 8
	d, cg := openSockTable(t, size)
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	privtest.Join(t, cg)
	// A socket whose cookie picks a different entry in each part, alone
	// on the rule: cookies count up, so two in eight consecutive ones do;
	// the others are closed again.
	var c *fdCloser
	var at []uint32
	var cookie uint64
	for range 100 {
		c = dial(t, srv).(*fdCloser)
		if cookie = cookieOf(t, c); len(places(cookie, size)) == 3 {
			at = places(cookie, size)
			break
		}
		c.Close()
		c = nil
	}
	if c == nil {
		t.Fatal("100 sockets in a row with cookies that pick the same entry in two parts")
	}
	roundTrip(t, c)
	var ss egressdSockState
	if err := d.maps().SockTable.Lookup(at[0], &ss); err != nil || ss.Word != cookie<<2|1 {
		t.Fatalf("hot entry %d: word %#x (%v), want the socket's (cookie %d) held", at[0], ss.Word, err, cookie)
	}

	// Move its state where each build before put it.
	var before Stats
	for i, to := range at[1:] {
		moveEntry(t, d, at[i], to)
		roundTrip(t, c)
		before = stats(t, d, "r")
		if want := uint64(i + 2); before.Requests != want || before.Responses != want || before.InFlight != 0 || before.Live != 1 {
			t.Errorf("in entry %d: requests %d, responses %d, in flight %d, live %d; want %d, %d, 0, 1", to, before.Requests, before.Responses, before.InFlight, before.Live, want, want)
		}
		rc, err := d.Recount()
		if err != nil {
			t.Fatal(err)
		}
		if r := rc["r"]; r.Counted != 1 || r.Drift() != 0 {
			t.Errorf("in entry %d: recount %+v (drift %d), want the socket counted", to, r, r.Drift())
		}
	}
	c.Close()
	if s := waitLive(t, d, "r", 0); s.Released != before.Released+1 {
		t.Errorf("released %d, want %d", s.Released, before.Released+1)
	}
	far := at[2]
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
	srv := echoServer(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.PrefixFrom(srv.Addr(), 32)}, Port: srv.Port(), Limit: 1000, Requests: true})
	privtest.Join(t, cg)
	// A socket egressd marked: beyond the hot part, its hot entry held
	// by another.
	open := map[uint64]*fdCloser{}
	var c *fdCloser
	var cookie uint64
	var near, from uint32
	for range 100 {
		x := dial(t, srv).(*fdCloser)
		k := cookieOf(t, x)
		open[k] = x
		at := places(k, size)
		for _, e := range at[1:] {
			if heldEntries(t, d)[e] == k {
				c, cookie, near, from = x, k, at[0], e
			}
		}
		if c != nil {
			break
		}
	}
	if c == nil {
		t.Fatal("100 sockets and none beyond the hot part")
	}
	other, ok := heldEntries(t, d)[near]
	if !ok {
		t.Fatalf("hot entry %d of a socket beyond it is not held", near)
	}
	open[other].Close()
	delete(open, other)
	// Now in the hot part, still marked.
	moveEntry(t, d, from, near)

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

// TestTableParts: the default table's parts are 16 and 1,024 entries
// (what the design doc and the benchmark's cases count on); a smaller
// table's, a quarter and a half of it.
func TestTableParts(t *testing.T) {
	for _, c := range []struct{ size, hot, warm int }{
		{65536, 16, 1024},
		{1 << 20, 16, 1024},
		{1024, 16, 512},
		{8, 2, 4},
		{2, 1, 1},
	} {
		if hot, warm := tableParts(c.size); hot != c.hot || warm != c.warm {
			t.Errorf("tableParts(%d) = %d, %d; want %d, %d", c.size, hot, warm, c.hot, c.warm)
		}
	}
}

// TestOverflowStateReconnects: a socket whose state is in the overflow
// table, refused by the peer and connected again, takes its entry again
// (it is not admitted untracked); its slot comes back once at each
// refusal's next step, and the entry goes at close.
func TestOverflowStateReconnects(t *testing.T) {
	d, cg := openSockTable(t, 4)
	srv := listen(t, "tcp4", "127.0.0.1:0")
	closed := closedPort(t)
	put(t, d, Rule{Name: "r", Dests: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Limit: 1000})
	privtest.Join(t, cg)
	// Enough connections held to take every table entry.
	for range 8 {
		dial(t, srv)
	}
	held := len(heldEntries(t, d))
	fd := socket4(t, 0)
	for i := range 3 {
		if err := unix.Connect(fd, sa4(closed)); err != unix.ECONNREFUSED {
			t.Fatalf("connect %d to a closed port: %v", i, err)
		}
		if n, err := d.OverflowSockets(); err != nil || n == 0 {
			t.Fatalf("connect %d: %d sockets in the overflow table (%v), want this one among them", i, n, err)
		}
	}
	unix.Close(fd)
	s := waitLive(t, d, "r", 8)
	if s.Untracked != 0 || s.Admitted != 8+3 || s.Released != 3 {
		t.Errorf("untracked %d, admitted %d, released %d; want 0, %d, 3 (%d table entries held)", s.Untracked, s.Admitted, s.Released, 8+3, held)
	}
	if n := overflowEntries(t, d); n != 8-held {
		t.Errorf("%d overflow table entries after the close, want the %d held connections'", n, 8-held)
	}
}
