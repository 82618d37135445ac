package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// The program against a dependency that fails once: the first request is
// retried, every request succeeds, and each prints its attempt log.
func TestRunAgainstADependency(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok"))
	}))
	t.Cleanup(srv.Close)

	var out bytes.Buffer
	if err := run(context.Background(), []string{"-url", srv.URL, "-n", "3", "-rate", "100"}, &out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"request 1: 200 OK after 2 attempts (success)\n    1: Throttled(retry after 0s) in ",
		"\n    2: OK in ",
		"request 2: 200 OK after 1 attempt (success)\n",
		"request 3: 200 OK after 1 attempt (success)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
}

// With no -url the program starts its own limited dependency; a client
// faster than it allows refuses itself rather than be refused.
func TestRunAgainstItsOwnDependency(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-n", "3", "-allow", "2", "-rate", "100"}, &out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"allows 2 requests per second\n",
		"request 2: 200 OK after 1 attempt (success)\n",
		"request 3: 200 OK after 2 attempts (success)\n    1: Throttled(self-imposed, retry after ",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
}

// A request that fails is part of the output, not the program's error.
func TestRunReportsFailures(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-url", srv.URL, "-n", "1"}, &out); err != nil {
		t.Fatal(err)
	}
	if want := "request 1: 404 Not Found after 1 attempt (permanent)\n    1: Permanent in "; !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}
}

func TestFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string // "" for no error
	}{
		{[]string{"-h"}, ""},
		{[]string{"-n", "-1"}, "-n -1 must not be negative"},
		{[]string{"-rate", "0"}, "-rate 0 must lie between"},
		{[]string{"-allow", "0"}, "-allow 0 must be at least 1"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"-bogus"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		err := run(context.Background(), tt.args, &bytes.Buffer{})
		if got := errString(err); !strings.Contains(got, tt.want) || (tt.want == "") != (err == nil) {
			t.Errorf("run(%q) = %v, want %q", tt.args, err, tt.want)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
