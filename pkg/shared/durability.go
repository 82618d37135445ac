package shared

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:generate go tool stringer -type=Durability -linecomment

// Durability says whether Redis keeps a concurrency budget's state through
// a restart or a failover. It matters for [Slots], whose holders enforce
// their slots where Redis cannot see (in a kernel): when Redis forgets the
// slots, the connections on them are still open.
type Durability uint8

const (
	// Ephemeral: Redis may lose the state (no persistence, a failover to
	// a replica that lacked the last writes). A budget Redis has no record
	// of (no epoch) may be one it forgot, so its growth is frozen for one
	// LeaseDuration, on Redis's clock: each holder takes back only what its
	// kernel may still hold, and nothing grows until every holder had a
	// lease to come back. Its first use is frozen too: Redis cannot tell
	// the two apart. The default.
	Ephemeral Durability = iota // ephemeral
	// Persistent: Redis keeps the state (an AOF with appendfsync
	// everysec or always; a process restart loses nothing it
	// acknowledged). A budget Redis has no record of is new, and grows at
	// once, unless a holder that held slots of it says otherwise (it then
	// freezes, as Ephemeral does).
	Persistent // persistent

	durabilityLen = iota // sentinel, untyped for stringer; keep last.
)

// DefaultReplicaWait is ReplicaWait when it is zero.
const DefaultReplicaWait = 100 * time.Millisecond

// replication lists the problems with the durability settings.
func replication(d Durability, replicas int, wait time.Duration) []string {
	var problems []string
	if d >= durabilityLen {
		problems = append(problems, fmt.Sprintf("Durability %d is neither Ephemeral nor Persistent", d))
	}
	if replicas < 0 {
		problems = append(problems, fmt.Sprintf("Replicas %d must not be negative", replicas))
	}
	if wait < 0 || (wait > 0 && wait < time.Millisecond) {
		problems = append(problems, fmt.Sprintf("ReplicaWait %v must be at least 1ms (0 means %v)", wait, DefaultReplicaWait))
	}
	return problems
}

// replicaWait runs a script and, when replicas are asked for, Redis's
// WAIT after it on the same connection, in one pipeline: WAIT counts the
// replicas that have every write this connection made.
type replicaWait struct {
	n       int
	timeout time.Duration
}

// pipeliner is a client that can send a script and WAIT on one connection.
type pipeliner interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
}

// clusterClient finds the node that owns a key.
type clusterClient interface {
	MasterForKey(ctx context.Context, key string) (*redis.Client, error)
}

func newReplicaWait(client redis.Scripter, n int, timeout time.Duration) (replicaWait, error) {
	if timeout == 0 {
		timeout = DefaultReplicaWait
	}
	w := replicaWait{n: n, timeout: timeout}
	if n == 0 {
		return w, nil
	}
	_, pipes := client.(pipeliner)
	_, cluster := client.(clusterClient)
	if !pipes && !cluster {
		return w, &OptionsError{Problems: []string{fmt.Sprintf("Replicas %d needs a client that pipelines (*redis.Client or *redis.ClusterClient), not a %T", n, client)}}
	}
	return w, nil
}

// run runs script on keys (as runScript does) and reports whether w.n
// replicas confirmed its writes; with none asked for, they always did.
func (w replicaWait) run(ctx context.Context, c redis.Scripter, script *redis.Script, name, op string, keys []string, want int, args ...any) ([]int64, bool, error) {
	if w.n == 0 {
		vals, err := runScript(ctx, c, script, name, op, keys, want, args...)
		return vals, true, err
	}
	var vals []int64
	var acked int64
	var err error
	for attempt := 0; ; attempt++ {
		vals, acked, err = w.once(ctx, c, script, keys, args)
		if err == nil || attempt >= DefaultMaxRetries || !(retryable(err) || isNoScript(err)) || ctx.Err() != nil {
			break
		}
		if isNoScript(err) {
			err = script.Load(ctx, c).Err()
			if err != nil {
				break
			}
			continue
		}
		if err := sleep(ctx, backoff(attempt)); err != nil {
			return nil, false, err
		}
	}
	if err == nil && len(vals) != want {
		err = errors.New("script returned " + strconv.Itoa(len(vals)) + " values, want " + strconv.Itoa(want))
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, false, cerr
		}
		return nil, false, &StoreError{Limiter: name, Op: op, Err: err}
	}
	return vals, acked >= int64(w.n), nil
}

func (w replicaWait) once(ctx context.Context, c redis.Scripter, script *redis.Script, keys []string, args []any) ([]int64, int64, error) {
	p, ok := c.(pipeliner)
	if cc, isCluster := c.(clusterClient); isCluster {
		node, err := cc.MasterForKey(ctx, keys[0])
		if err != nil {
			return nil, 0, err
		}
		p, ok = node, true
	}
	if !ok {
		return nil, 0, fmt.Errorf("a %T cannot pipeline", c)
	}
	pipe := p.Pipeline()
	run := evalSha(ctx, pipe, script, keys, args)
	wait := pipe.Do(ctx, "WAIT", w.n, w.timeout.Milliseconds())
	_, _ = pipe.Exec(ctx) // each command's error is its own
	vals, err := run.Int64Slice()
	if err != nil {
		return nil, 0, err
	}
	acked, err := wait.Int64()
	if err != nil {
		return nil, 0, fmt.Errorf("wait for replicas: %w", err)
	}
	return vals, acked, nil
}

func isNoScript(err error) bool { return redis.HasErrorPrefix(err, "NOSCRIPT") }
