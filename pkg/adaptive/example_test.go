package adaptive_test

import (
	"fmt"
	"time"

	"github.com/egressd/egressd/pkg/adaptive"
)

func Example() {
	c, err := adaptive.New(&adaptive.Options{
		Maximum: 50,
		// A daemon would update the kernel map and a gauge here.
		OnChange: func(from, to int) { fmt.Printf("limit %d -> %d\n", from, to) },
	})
	if err != nil {
		panic(err)
	}
	t0 := time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)

	// A healthy dependency answering in 10ms, with every call at the limit:
	// one round, and the limit grows by one.
	for range c.Limit() {
		c.Constrained()
		c.Sample(t0, 10*time.Millisecond)
	}
	// Then a round in which even the fastest call takes 30ms: a queue.
	for range c.Limit() {
		c.Sample(t0.Add(time.Second), 30*time.Millisecond)
	}
	b, _ := c.Baseline()
	fmt.Println(c.Limit(), b.Round(time.Millisecond))
	// Output:
	// limit 20 -> 21
	// limit 21 -> 18
	// 18 10ms
}
