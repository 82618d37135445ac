package sdkquic

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/quic-go/quic-go"
)

// A refused dial's error reads as quic-go's, and errors.As finds the
// send's *net.OpError in it, which the SDK's attributor asks about.
func TestRefusedErrorWrapsTheSend(t *testing.T) {
	send := &net.OpError{Op: "write", Net: "udp", Addr: &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 443}, Err: os.NewSyscallError("sendmsg", syscall.EPERM)}
	dial := &quic.TransportError{ErrorCode: quic.InternalError, ErrorMessage: send.Error()}
	err := error(&refusedError{dial: dial, send: send})
	if err.Error() != dial.Error() {
		t.Errorf("Error() = %q, want quic-go's %q", err, dial)
	}
	var op *net.OpError
	var te *quic.TransportError
	if !errors.As(err, &op) || op != send || !errors.As(err, &te) || !errors.Is(err, syscall.EPERM) {
		t.Errorf("%v does not wrap both the send's error and quic-go's", err)
	}
}

func TestDialBadInput(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		addr string
		tls  *tls.Config
	}{
		{"127.0.0.1:443", nil},
		{"127.0.0.1", &tls.Config{}},
		{"127.0.0.1:no-such-port-name", &tls.Config{}},
	} {
		if c, err := Dial(ctx, tt.addr, tt.tls, nil); err == nil {
			c.CloseWithError(0, "")
			t.Errorf("Dial(%q, tls %v) succeeded", tt.addr, tt.tls != nil)
		}
	}
}

func TestResolve(t *testing.T) {
	addr, host, err := resolve(context.Background(), "127.0.0.1:8443")
	if err != nil || addr.String() != "127.0.0.1:8443" || host != "127.0.0.1" {
		t.Errorf("resolve = %v, %q, %v", addr, host, err)
	}
	addr, host, err = resolve(context.Background(), "[::1]:8443")
	if err != nil || addr.String() != "[::1]:8443" || host != "::1" {
		t.Errorf("resolve = %v, %q, %v", addr, host, err)
	}
}
