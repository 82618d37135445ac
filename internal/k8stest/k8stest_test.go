package k8stest

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// The server started serves the default namespace to the admin, and
// refuses a request without its token.
func TestStart(t *testing.T) {
	s := Start(t)
	resp, err := s.Get("/api/v1/namespaces/default")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"name":"default"`) {
		t.Fatalf("default namespace: %s %s", resp.Status, body)
	}
	s.Token = "wrong"
	resp, err = s.Get("/api/v1/namespaces/default")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %s, want 401", resp.Status)
	}
}
