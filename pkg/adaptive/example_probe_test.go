package adaptive_test

import (
	"fmt"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

func ExampleOptions_probeEvery() {
	c, err := adaptive.New(&adaptive.Options{
		ProbeEvery: 100,
		OnChange:   func(from, to int) { fmt.Printf("limit %d -> %d\n", from, to) },
	})
	if err != nil {
		panic(err)
	}
	t0 := time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

	// The first round with a baseline is judged against the window (20 ->
	// 21), and the first probe starts at its end, at half the limit.
	for range c.Limit() {
		c.Constrained()
		c.Sample(t0, 10*time.Millisecond)
	}
	restore, _ := c.Probing()
	fmt.Println("probing; will restore", restore)

	// Calls that started at t0 or later are the probe's. Eleven of them
	// end it, and their 10th percentile is the baseline from now on.
	for range 11 {
		c.Sample(t0.Add(10*time.Millisecond), 10*time.Millisecond)
	}
	_, probing := c.Probing()
	b, _ := c.Baseline()
	fmt.Println(c.Limit(), probing, b.Round(time.Millisecond))
	// Output:
	// limit 20 -> 11
	// probing; will restore 21
	// limit 11 -> 21
	// 21 false 10ms
}
