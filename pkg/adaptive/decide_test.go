package adaptive

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

func TestNext(t *testing.T) {
	const baseline = 10 * time.Millisecond
	tests := []struct {
		name        string
		opts        Options
		limit       int
		fastest     time.Duration
		constrained bool
		want        int
	}{
		{name: "queue: decrease", limit: 20, fastest: 25 * time.Millisecond, want: 18},
		{name: "queue wins over constrained", limit: 20, fastest: 25 * time.Millisecond, constrained: true, want: 18},
		{name: "exactly Multiple × baseline is not a queue", limit: 20, fastest: 20 * time.Millisecond, constrained: true, want: 21},
		{name: "fast and constrained: grow", limit: 20, fastest: baseline, constrained: true, want: 21},
		{name: "fast and idle: hold", limit: 20, fastest: baseline, want: 20},
		{name: "ceiling", limit: 200, fastest: baseline, constrained: true, want: 200},
		{name: "floor", limit: 4, fastest: time.Second, want: 4},
		{name: "rounds down: 19 × 0.9 = 17.1", limit: 19, fastest: time.Second, want: 17},
		{name: "rounds down: 5 × 0.9 = 4.5", limit: 5, fastest: time.Second, want: 4},
		{name: "exact products stay exact: 30 × 0.9", limit: 30, fastest: time.Second, want: 27},
		{name: "200 × 0.9", limit: 200, fastest: time.Second, want: 180},
		{name: "never below Minimum", opts: Options{DecreaseFactor: 0.5}, limit: 6, fastest: time.Second, want: 4},
		{name: "moves by at least one: the largest factor below 1", opts: Options{DecreaseFactor: math.Nextafter(1, 0)}, limit: 200, fastest: time.Second, want: 199},
		{name: "small Minimum", opts: Options{Minimum: 1}, limit: 2, fastest: time.Second, want: 1},
		{name: "Multiple 3: 25ms is not a queue", opts: Options{Multiple: 3}, limit: 20, fastest: 25 * time.Millisecond, constrained: true, want: 21},
		{name: "Multiple 3: 31ms is", opts: Options{Multiple: 3}, limit: 20, fastest: 31 * time.Millisecond, constrained: true, want: 18},
		{name: "MaxHealthy: slower decreases, whatever the baseline", opts: Options{MaxHealthy: 15 * time.Millisecond}, limit: 20, fastest: 16 * time.Millisecond, constrained: true, want: 18},
		{name: "MaxHealthy: at it, the baseline judges", opts: Options{MaxHealthy: 15 * time.Millisecond}, limit: 20, fastest: 15 * time.Millisecond, constrained: true, want: 21},
		{name: "MaxHealthy above a queue: the queue still decreases", opts: Options{MaxHealthy: time.Second}, limit: 20, fastest: 25 * time.Millisecond, want: 18},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := tt.opts.withDefaults()
			if got := o.next(tt.limit, tt.fastest, baseline, tt.constrained); got != tt.want {
				t.Errorf("next(%d, %v, %v, %t) = %d; want %d", tt.limit, tt.fastest, baseline, tt.constrained, got, tt.want)
			}
		})
	}
}

// TestBucketError checks the histogram layout itself: every latency maps to a
// bucket whose midpoint is within 1/64 of it, buckets are in order, and the
// range ends at the last bucket.
func TestBucketError(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	prev := 0
	for exp := range maxBits {
		for range 2000 {
			v := time.Duration(1)<<exp + time.Duration(r.Int64N(1<<exp))
			v = min(v, maxLatency)
			got := valueOf(bucketOf(v))
			if (got-v).Abs()*64 > v {
				t.Fatalf("latency %d: bucket %d midpoint %d", v, bucketOf(v), got)
			}
		}
		if b := bucketOf(time.Duration(1) << exp); b < prev {
			t.Fatalf("bucket of 2^%d is %d, below %d", exp, b, prev)
		}
		prev = bucketOf(time.Duration(1) << exp)
	}
	if bucketOf(maxLatency) != buckets-1 || bucketOf(time.Hour) != buckets-1 || bucketOf(-time.Second) != 0 {
		t.Fatalf("range: max %d, hour %d, negative %d; want %d, %d, 0",
			bucketOf(maxLatency), bucketOf(time.Hour), bucketOf(-time.Second), buckets-1, buckets-1)
	}
}

// TestDecreaseAlwaysMoves backs decrease's claim that flooring moves every
// limit above Minimum by at least one, whatever the factor.
func TestDecreaseAlwaysMoves(t *testing.T) {
	o := Options{Minimum: 1, DecreaseFactor: math.Nextafter(1, 0)}
	for limit := 2; limit <= 1<<20; limit++ {
		if got := o.decrease(limit); got != limit-1 {
			t.Fatalf("decrease(%d) = %d; want %d", limit, got, limit-1)
		}
	}
}
