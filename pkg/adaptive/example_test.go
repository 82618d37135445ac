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
	// the first round judged, and the first drain probe begins at once, at
	// Minimum, to learn what a call costs without our queue.
	for range c.Limit() {
		c.Constrained()
		c.Sample(t0, 10*time.Millisecond)
	}
	// It measures 200 calls admitted during it, and holds on for 30% of
	// its period (2^31ns, about 2.1s, for 100 rounds of 2 × 10ms) so that
	// the probes of other hosts calling the dependency drain it with it.
	t1 := t0.Add(time.Second)
	for range 200 {
		c.Sample(t1, 10*time.Millisecond)
	}
	b, _ := c.Baseline()
	fmt.Println("baseline", b.Round(time.Millisecond))
	// Then a round in which even the fastest call takes 30ms: a queue.
	for range c.Limit() {
		c.Sample(t1.Add(time.Second), 30*time.Millisecond)
	}
	// Output:
	// limit 20 -> 4
	// limit 4 -> 21
	// baseline 10ms
	// limit 21 -> 18
}

func ExampleOptions_noProbes() {
	c, err := adaptive.New(&adaptive.Options{
		// The reference loop exactly: judged against the 10th percentile
		// of the last five minutes of calls.
		ProbeEvery: adaptive.NoProbes,
		OnChange:   func(from, to int) { fmt.Printf("limit %d -> %d\n", from, to) },
	})
	if err != nil {
		panic(err)
	}
	t0 := time.Date(2025, time.January, 1, 0, 0, 0, 0, time.UTC)
	for range c.Limit() {
		c.Constrained()
		c.Sample(t0, 10*time.Millisecond)
	}
	for range c.Limit() {
		c.Sample(t0.Add(time.Second), 30*time.Millisecond)
	}
	fmt.Println(c.State().Source)
	// Output:
	// limit 20 -> 21
	// limit 21 -> 18
	// window
}
