package controlserver

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/egressd/egressd/pkg/control"
)

// fuzzRule is shaped like the requests the daemon will take: nested
// objects, pointers, slices, maps, a TextUnmarshaler, raw JSON.
type fuzzRule struct {
	Name        string            `json:"name"`
	Destination netip.Prefix      `json:"destination"`
	Port        uint16            `json:"port"`
	Shadow      *bool             `json:"shadow"`
	Concurrency int               `json:"concurrency"`
	PerSecond   *fuzzPerSecond    `json:"perSecond"`
	Window      time.Duration     `json:"window"`
	Labels      map[string]string `json:"labels"`
	Ports       []uint16          `json:"ports"`
	Extra       json.RawMessage   `json:"extra"`
	Any         any               `json:"any"`
}

type fuzzPerSecond struct {
	Permits float64 `json:"permits"`
	Burst   int32   `json:"burst"`
}

// FuzzDecode feeds arbitrary bodies to the request decoder: it must never
// panic, every refusal must be an invalid-request error with a message,
// and whatever it accepts must survive a round trip.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		``, ` `, `{}`, `null`, `[]`, `"x"`, `1`, `{"name":"payments","destination":"10.20.0.0/16","port":443,"concurrency":50}`,
		`{"perSecond":{"permits":10,"burst":20}}`, `{"labels":{"a":"b"},"ports":[1,2]}`, `{"extra":{"x":[1,{"y":null}]}}`,
		`{"name":"x"} {"name":"y"}`, `{"name":`, `{"bogus":1}`, `{"perSecond":{"bogus":1}}`, `{"port":-1}`,
		`{"port":65536}`, `{"destination":"not a prefix"}`, `{"window":1e400}`, `{"any":[[[[[[[[[[]]]]]]]]]]}`,
		"{\"name\":\"\xff\xfe\"}", `{"name":"\ud800"}`, `{"Name":"case"}`, `{"name":"x"}` + "\n\t ",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var r fuzzRule
		err := decode(bytes.NewReader(body), &r, false)
		if err != nil {
			var e *control.Error
			if !errors.As(err, &e) || e.Code != control.CodeInvalid || e.Message == "" {
				t.Fatalf("decode(%q): %#v, want an invalid-request *control.Error", body, err)
			}
			if status, w := classify(err); status != 400 || w.Code != control.CodeInvalid {
				t.Fatalf("decode(%q): answered %d %s", body, status, w.Code)
			}
			if len(body) <= MaxBodyBytes && strings.Contains(e.Message, "larger than") {
				t.Fatalf("decode(%q): %d bytes called too large", body, len(body))
			}
			return
		}
		again, err := json.Marshal(r)
		if err != nil {
			t.Fatalf("decode(%q) accepted %+v, which does not encode: %v", body, r, err)
		}
		var r2 fuzzRule
		if err := decode(bytes.NewReader(again), &r2, false); err != nil {
			t.Fatalf("decode(%q) accepted %+v, whose encoding %q is refused: %v", body, r, again, err)
		}
		// And the generic shapes handlers may use.
		var m map[string]any
		decode(bytes.NewReader(body), &m, true)
		var v any
		decode(bytes.NewReader(body), &v, true)
	})
}

func TestDecodeNotAPointer(t *testing.T) {
	var r fuzzRule
	err := decode(strings.NewReader(`{}`), r, false)
	if status, w := classify(err); status != 500 || w.Code != control.CodeInternal {
		t.Errorf("non-pointer target: %v answered %d %s, want 500 internal (a handler bug)", err, status, w.Code)
	}
}

func TestDecodeExactLimit(t *testing.T) {
	pad := MaxBodyBytes - len(`{"name":""}`)
	body := `{"name":"` + strings.Repeat("x", pad) + `"}`
	var r fuzzRule
	if err := decode(strings.NewReader(body), &r, false); err != nil || len(r.Name) != pad {
		t.Errorf("body of exactly MaxBodyBytes: %v", err)
	}
	if err := decode(strings.NewReader(body+" "), &r, false); err == nil || !strings.Contains(err.Error(), "larger than 1 MiB") {
		t.Errorf("body one byte over: %v", err)
	}
}
