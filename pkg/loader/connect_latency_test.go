//go:build linux

package loader

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/egressd/egressd/internal/clocktest"
	"github.com/egressd/egressd/internal/privtest"
)

// TestConnectLatencySample checks a connect latency sample against the
// client's own clock on a handshake that takes seconds: the listener's
// accept queue is full until the connect() has sent its SYN again, so the
// first SYN and the second (after TCP's initial timeout, 1s) are dropped,
// and the third completes the handshake, 2s in (3s where the kernel
// doubles the timeout at once).
// The sample runs from the first SYN to the SYN-ACK, so it lies within what
// the client saw; an end at a stamp TCP took before the SYN-ACK came, or
// a start at the SYN sent again, would make it far shorter.
func TestConnectLatencySample(t *testing.T) {
	d, cg := open(t)
	// Full once the filler's connection waits in it.
	fd, dest := zeroBacklog(t)
	put(t, d, Rule{Name: "slow", Dests: []netip.Prefix{netip.PrefixFrom(dest.Addr(), 32)}, Port: dest.Port(), Limit: 10, Samples: true})
	samples := openSamples(t, d)
	privtest.Join(t, cg)

	filler, err := net.Dial("tcp4", dest.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { filler.Close() })
	cfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(cfd) })
	start := time.Now()
	if err := unix.Connect(cfd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}, Port: int(dest.Port())}); err != unix.EINPROGRESS {
		t.Fatalf("connect: %v", err)
	}
	// Room for it once a SYN of its own has gone unanswered: the
	// socket's count, where the namespace's count of dropped SYNs moves
	// with other tests' listeners too.
	clocktest.Eventually(t, "the connect() to resend its SYN", func() bool {
		info, err := unix.GetsockoptTCPInfo(cfd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			t.Fatal(err)
		}
		return info.Retransmits > 0
	})
	nfd, _, err := unix.Accept(fd)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(nfd)
	pfd := []unix.PollFd{{Fd: int32(cfd), Events: unix.POLLOUT}}
	if n, err := unix.Poll(pfd, 10_000); n != 1 || err != nil {
		t.Fatalf("connect: poll %d, %v", n, err)
	}
	took := time.Since(start)
	if soErr, err := unix.GetsockoptInt(cfd, unix.SOL_SOCKET, unix.SO_ERROR); soErr != 0 || err != nil {
		t.Fatalf("connect: %v, %v", unix.Errno(soErr), err)
	}
	if took < 500*time.Millisecond {
		t.Fatalf("connect() took %v: its first SYN was not the one dropped, so this checks nothing", took)
	}

	samples.SetDeadline(time.Now().Add(5 * time.Second))
	for range 2 { // the filler's, then the slow one's
		s, err := samples.Read()
		if err != nil {
			t.Fatal(err)
		}
		if s.Kind != SampleConnect || s.Rule != "slow" {
			t.Fatalf("sample %+v", s)
		}
		if s.Latency < 10*time.Millisecond {
			continue // the filler's
		}
		t.Logf("connect() took %v; its sample %v", took, s.Latency)
		if s.Latency < took-500*time.Millisecond || s.Latency > took {
			t.Fatalf("sample %v, want within the %v connect() took (and at most 500ms less)", s.Latency, took)
		}
		return
	}
	t.Fatal("no sample of the slow connect")
}
