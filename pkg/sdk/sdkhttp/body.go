package sdkhttp

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"sync/atomic"

	"github.com/egressd/egressd/pkg/limit"
)

// body is a response body that lets go of what its attempt held - the
// attempt's request context, a limiter's lease - once, at the first of EOF,
// a read error or Close.
type body struct {
	rc     io.ReadCloser
	done   atomic.Bool
	cancel context.CancelFunc // nil: none
	lease  limit.Lease        // the zero Lease: none
}

// rwBody is a body that is also the connection: a 101 Switching Protocols
// response's, which callers assert to io.ReadWriteCloser.
type rwBody struct {
	*body
	w io.Writer
}

func (b rwBody) Write(p []byte) (int, error) { return b.w.Write(p) }

// wrapResponse makes resp's body let go of cancel and lease when it is
// done. A response without a body lets go at once.
func wrapResponse(resp *http.Response, cancel context.CancelFunc, lease limit.Lease) {
	if resp.Body == nil {
		lease.Release()
		if cancel != nil {
			cancel()
		}
		return
	}
	b := &body{rc: resp.Body, cancel: cancel, lease: lease}
	if w, ok := resp.Body.(io.Writer); ok {
		resp.Body = rwBody{body: b, w: w}
		return
	}
	resp.Body = b
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil {
		b.finish()
	}
	return n, err
}

func (b *body) Close() error {
	err := b.rc.Close()
	b.finish()
	return err
}

func (b *body) finish() {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	b.lease.Release()
	if b.cancel != nil {
		b.cancel()
	}
}

// maxErrorBody is how much of a failed response's body an attempt reads
// into memory, so that its connection and permits are free during the
// backoff.
const maxErrorBody = 64 << 10

// bufferBody reads resp's body into memory, up to maxErrorBody, and closes
// it; a longer body (or one that failed) is handed on as what was read
// followed by the rest, still open.
func bufferBody(resp *http.Response) {
	if resp.Body == nil || resp.Body == http.NoBody {
		return
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
	if err == nil && len(buf) <= maxErrorBody {
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(buf))
		return
	}
	rest := io.Reader(resp.Body)
	if err != nil {
		rest = errReader{err}
	}
	resp.Body = prefixBody{Reader: io.MultiReader(bytes.NewReader(buf), rest), Closer: resp.Body}
}

type prefixBody struct {
	io.Reader
	io.Closer
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// discard drains a little of a response nobody will read, so that its
// connection can be reused, and closes it.
func discard(resp *http.Response) {
	if resp == nil || resp.Body == nil {
		return
	}
	io.CopyN(io.Discard, resp.Body, 4<<10)
	resp.Body.Close()
}
