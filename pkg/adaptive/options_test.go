package adaptive_test

import (
	"errors"
	"math"
	"slices"
	"testing"

	"github.com/egressd/egressd/pkg/adaptive"
)

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		opts *adaptive.Options
		want []string
	}{
		{name: "nil is all defaults", opts: nil},
		{name: "zero is all defaults", opts: &adaptive.Options{}},
		{name: "bounds may meet", opts: &adaptive.Options{Minimum: 1, Initial: 1, Maximum: 1}},
		{
			name: "a lowered Maximum must cover the default Initial",
			opts: &adaptive.Options{Maximum: 10},
			want: []string{"Initial 20 (default) must lie between Minimum 4 (default) and Maximum 10"},
		},
		{
			name: "every problem at once",
			opts: &adaptive.Options{Minimum: -1, Maximum: -2, Initial: 3, Multiple: 1, DecreaseFactor: 1},
			want: []string{
				"Minimum -1 must be at least 1",
				"Maximum -2 must be at least Minimum -1",
				"Initial 3 must lie between Minimum -1 and Maximum -2",
				"Multiple 1 must be a finite number above 1",
				"DecreaseFactor 1 must lie strictly between 0 and 1",
			},
		},
		{
			name: "not a number",
			opts: &adaptive.Options{Multiple: math.NaN(), DecreaseFactor: math.NaN()},
			want: []string{
				"Multiple NaN must be a finite number above 1",
				"DecreaseFactor NaN must lie strictly between 0 and 1",
			},
		},
		{
			name: "infinite Multiple, negative factor",
			opts: &adaptive.Options{Multiple: math.Inf(1), DecreaseFactor: -0.5},
			want: []string{
				"Multiple +Inf must be a finite number above 1",
				"DecreaseFactor -0.5 must lie strictly between 0 and 1",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.opts.Validate()
			var oe *adaptive.OptionsError
			errors.As(err, &oe)
			if got := problems(oe); !slices.Equal(got, tt.want) || errors.Is(err, adaptive.ErrInvalidOptions) != (len(tt.want) > 0) {
				t.Errorf("Validate() = %v; want problems %q", err, tt.want)
			}
		})
	}
}

func problems(e *adaptive.OptionsError) []string {
	if e == nil {
		return nil
	}
	return e.Problems
}

func TestNewRefusesInvalidOptions(t *testing.T) {
	c, err := adaptive.New(&adaptive.Options{Minimum: 50, Maximum: 10})
	if c != nil || !errors.Is(err, adaptive.ErrInvalidOptions) {
		t.Fatalf("New = %v, %v; want nil, ErrInvalidOptions", c, err)
	}
	const want = "invalid adaptive options: Maximum 10 must be at least Minimum 50; " +
		"Initial 20 (default) must lie between Minimum 50 and Maximum 10"
	if err.Error() != want {
		t.Fatalf("error %q; want %q", err, want)
	}
}

func TestNewDefaults(t *testing.T) {
	c, err := adaptive.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, ok := c.Baseline(); c.Limit() != adaptive.DefaultInitial || ok {
		t.Fatalf("new controller: limit %d, baseline %v %t; want %d and none", c.Limit(), b, ok, adaptive.DefaultInitial)
	}
}
