package controlserver_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"

	"github.com/egressd/egressd/internal/controlserver"
	"github.com/egressd/egressd/pkg/control"
)

// A daemon serves a route table; the CLI calls it by route name.
func Example() {
	dir, err := os.MkdirTemp("", "egc")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "egressd.sock")

	type status struct {
		Rules int `json:"rules"`
	}
	type ruleName struct {
		Name string `json:"name"`
	}
	srv, err := controlserver.New(controlserver.Config{
		Socket: sock,
		Group:  "", // e.g. "egressd": its members may change limits
		Routes: map[string]controlserver.Route{
			"status": {Method: http.MethodGet, Handler: controlserver.JSON(func(r *http.Request, _ struct{}) (status, error) {
				return status{Rules: 3}, nil
			})},
			"limit/rm": {Method: http.MethodPost, Write: true, Handler: controlserver.JSON(func(r *http.Request, in ruleName) (struct{}, error) {
				return struct{}{}, control.Errorf(control.CodeNotFound, "no rule %q", in.Name)
			})},
		},
	})
	if err != nil {
		panic(err)
	}
	ln, err := srv.Listen()
	if err != nil {
		panic(err)
	}
	go srv.Serve(ln)
	defer srv.Close()

	ctx := context.Background()
	c := &control.Client{Socket: sock}
	var st status
	if err := c.Get(ctx, "status", &st); err != nil {
		panic(err)
	}
	fmt.Println("rules:", st.Rules)

	err = c.Post(ctx, "limit/rm", ruleName{Name: "payments"}, nil)
	fmt.Println(err, errors.Is(err, control.ErrNotFound))

	// Output:
	// rules: 3
	// no rule "payments" true
}
