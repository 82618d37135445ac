package shared

import (
	"context"
	"errors"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// The admission scripts. Each reads the server's clock, in microseconds (a
// double holds them exactly), and returns {admitted, retry after µs,
// available, window or segment id}. Numbers written back are formatted with
// %.0f: Redis would otherwise print a large Lua number with too few digits.
//
// Scripts that call TIME and then write are replicated by their effects,
// which Redis has done by default since 5.0.

const clockLua = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function f(x) return string.format('%.0f', x) end
`

// fixedWindowLua: KEYS[1] a hash {w = window id, n = permits counted};
// ARGV permits, window µs.
var fixedWindowLua = redis.NewScript(clockLua + `
local limit, win = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now / win)
local s = redis.call('HMGET', KEYS[1], 'w', 'n')
local n = 0
if tonumber(s[1]) == cur then n = tonumber(s[2]) end
local left = (cur + 1) * win - now
if n < limit then
  redis.call('HSET', KEYS[1], 'w', f(cur), 'n', n + 1)
  redis.call('PEXPIRE', KEYS[1], math.ceil(left / 1000) + 1)
  return {1, 0, limit - n - 1, cur}
end
return {0, left, 0, cur}
`)

// windowLua reads a sliding window, KEYS[1], a hash of segment id →
// permits counted in it, for the scripts that spend from it (Limiter's and
// Grants'), so that they cannot come to read it differently.
// window(seg µs, segments) drops the segments that left the window and
// returns the current segment's id, the permits counted, the oldest counted
// segment's id (cur when none) and the live segments as {id, field, n}.
// keepWindow(cur, seg, segments) makes the key outlive the current segment's
// time in the window.
const windowLua = `
local function window(seg, segs)
  local cur = math.floor(now / seg)
  local h = redis.call('HGETALL', KEYS[1])
  local live, total, oldest = {}, 0, cur
  for i = 1, #h, 2 do
    local id = tonumber(h[i])
    if id + segs <= cur then
      redis.call('HDEL', KEYS[1], h[i])
    else
      local n = tonumber(h[i + 1])
      live[#live + 1] = {id, h[i], n}
      total = total + n
      if id < oldest then oldest = id end
    end
  end
  return cur, total, oldest, live
end
local function keepWindow(cur, seg, segs)
  redis.call('PEXPIRE', KEYS[1], math.ceil(((cur + segs) * seg - now) / 1000) + 1)
end
`

// slidingWindowLua: KEYS[1] a hash of segment id → permits counted in it;
// ARGV permits, segment µs, segments.
var slidingWindowLua = redis.NewScript(clockLua + windowLua + `
local limit, seg, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cur, total, oldest = window(seg, n)
if total < limit then
  redis.call('HINCRBY', KEYS[1], f(cur), 1)
  keepWindow(cur, seg, n)
  return {1, 0, limit - total - 1, cur}
end
local wait = (oldest + n) * seg - now
if wait < 1 then wait = 1 end
return {0, wait, 0, cur}
`)

// bucketLua reads and writes a token bucket, KEYS[1], a hash {t = tokens,
// l = time of the latest refill, µs}, for the scripts that spend from it
// (Limiter's and Grants'), so that they cannot come to refill it
// differently. bucket(limit, tokens per period, period µs) returns the
// tokens and the latest refill, refilled up to now; a missing bucket is
// full. saveBucket(limit, per, period, tokens, last) writes them back; the
// key expires when the bucket would be full again.
const bucketLua = `
local function bucket(limit, per, period)
  local s = redis.call('HMGET', KEYS[1], 't', 'l')
  local tokens, last = tonumber(s[1]), tonumber(s[2])
  if tokens == nil or last == nil then tokens, last = limit, now end
  if now > last then
    local p = math.floor((now - last) / period)
    if p > 0 then
      tokens = math.min(limit, tokens + p * per)
      last = last + p * period
    end
  end
  if tokens >= limit then tokens, last = limit, now end
  return tokens, last
end
local function saveBucket(limit, per, period, tokens, last)
  redis.call('HSET', KEYS[1], 't', f(tokens), 'l', f(last))
  local full = last + math.ceil((limit - tokens) / per) * period - now
  local ttl = math.ceil(full / 1000) + 1
  if ttl < 1 then ttl = 1 end
  redis.call('PEXPIRE', KEYS[1], ttl)
end
`

// tokenBucketLua: KEYS[1] the bucket (see bucketLua); ARGV limit, tokens
// per period, period µs.
var tokenBucketLua = redis.NewScript(clockLua + bucketLua + `
local limit, per, period = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, last = bucket(limit, per, period)
local ok = 0
if tokens >= 1 then tokens, ok = tokens - 1, 1 end
saveBucket(limit, per, period, tokens, last)
if ok == 1 then return {1, 0, tokens, 0} end
local wait = last + period - now
if wait < 1 then wait = 1 end
return {0, wait, 0, 0}
`)

// concurrencyLua: KEYS the budget's (see slotsLua: the set, the demands,
// their expiries, the epoch, the counts, the holders above the level);
// ARGV permits, lease µs, holders (1: Slots holders share the key),
// persistent (1: Redis keeps its state), lease id. Expired leases are
// dropped before counting. While the budget's growth is frozen (holders of
// Slots taking back what their kernels hold after Redis lost the state)
// nothing is admitted, and the refusal says until when. With holders, a
// missing epoch is made as slotsLua makes it for a caller that never held
// slots, frozen for a lease unless Redis is persistent, and a budget whose
// keys Redis dropped (see holdersLost) begins anew frozen: left to the
// holders, a Limiter could take the slots Redis forgot before any holder
// came back to freeze them.
var concurrencyLua = redis.NewScript(clockLua + lostLua + `
local limit, dur = tonumber(ARGV[1]), tonumber(ARGV[2])
local holders, persistent = ARGV[3] == '1', ARGV[4] == '1'
local SET, META = KEYS[1], KEYS[4]
local meta = redis.call('HMGET', META, 'epoch', 'frozen', 'until')
local frozen = tonumber(meta[2]) or 0
redis.call('ZREMRANGEBYSCORE', SET, '-inf', f(now))
if holders then
  local gone = tonumber(meta[1]) and holdersLost(tonumber(meta[3]) or 0)
  if gone then redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6]) end
  if gone or not tonumber(meta[1]) then
    frozen = 0
    if gone or not persistent then frozen = now + dur end
    redis.call('HSET', META, 'epoch', f(now), 'frozen', f(frozen), 'until', 0)
  end
end
if frozen > now then return {0, frozen - now, 0, 0} end
local n = redis.call('ZCARD', SET)
if n < limit then
  redis.call('ZADD', SET, f(now + dur), ARGV[5])
  redis.call('PEXPIRE', SET, math.ceil(dur / 1000) + 1)
  return {1, 0, limit - n - 1, 0}
end
return {0, 0, 0, 0}
`)

// lostLua: holdersLost(due) tells a budget whose keys Redis dropped before
// they were due to expire (evicted under a maxmemory policy, deleted) from
// one whose keys expired or were never made, so that the slots the
// holders' kernels still use are not handed out again: the counts (KEYS[5])
// gone though a recent Resize had them outlive due, a time past now; or
// fewer slots in the set (KEYS[1]) than the holders whose leases have not
// run out (KEYS[3]) hold by the counts. Call it after the set's expired
// leases were dropped. slotsLua makes the same test on what it reads. The epoch has no expiry, so no maxmemory policy
// that spares keys without one evicts it: without this check a budget that
// lost its set would be taken for one that kept it.
const lostLua = `
local function holdersLost(due)
  local total = redis.call('HGET', KEYS[5], ' total')
  if not total then return due > now end
  total = tonumber(total)
  for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', f(now))) do
    total = total - (tonumber(redis.call('HGET', KEYS[5], g)) or 0)
  end
  return redis.call('ZCARD', KEYS[1]) < total
end
`

// renewLua: KEYS[1] the concurrency set; ARGV lease µs, lease id. Extends a
// live lease and returns 1; an expired or released one is not recreated: 0.
var renewLua = redis.NewScript(clockLua + `
local dur = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', f(now))
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', f(now + dur), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(dur / 1000) + 1)
return 1
`)

// releaseLua: KEYS[1] the concurrency set; ARGV lease id.
var releaseLua = redis.NewScript(`return redis.call('ZREM', KEYS[1], ARGV[1])`)

// slotsLua: KEYS[1] the concurrency set, KEYS[2] a hash of holder →
// demand, KEYS[3] a sorted set of holder → expiry µs (of its demand and
// its slots, renewed together), KEYS[4] the budget's epoch, a hash {epoch
// = µs it was made, frozen = µs growth is frozen until}, KEYS[5] a hash of
// holder → slots held, with the fair shares' last computation under fields
// that start with a space (no holder does); KEYS[6] a sorted set of the
// holders that demand more than the fair level, by name. ARGV permits,
// lease µs, the holder's prefix (Holder + ":"), slots wanted, slots
// demanded, the holder, prior (slots the holder's kernel may still use),
// had (1: the holder held slots of this budget before), persistent (1:
// Redis keeps its state). Returns {slots held, fair share, epoch, µs
// growth stays frozen}.
//
// A holder's slots are its prefix followed by 1..held; extras go from the
// top. Its count is kept in KEYS[5], so no call walks the set, and one
// holder's call costs the same with a thousand others.
//
// The fair share is max-min: the permits not held by Limiters' leases (the
// set's members that are no holder's slots), filled up from the smallest
// demand. It is kept as a level L and a remainder r: a holder demanding at
// most L gets its demand, one demanding more gets L, or L + 1 for the
// first r of them by name. They are computed again only when they could
// change: a holder coming or going, a demand crossing L + 1, the Limiters'
// leases changing. A holder adds slots only up to its fair share, so a
// holder that demands little always gets it, and busy ones split the rest;
// one above its share is told so and gives slots back as its work drains.
// Key expiries are only ever raised: a shorter one would cut other
// holders' leases.
//
// The epoch tells a Redis that lost the budget's state (a restart without
// persistence, a failover to a replica without it) from one that kept it:
// it is made at first use and has no expiry, and 'until' in it is when the
// counts are due to expire. Missing, or present though Redis dropped the
// other keys (see holdersLost), it is made anew, and growth is frozen for
// a lease on Redis's clock: holders' kernels may still hold connections on
// slots Redis forgot, and each may take back only its prior while the
// others come back. The freeze is skipped only when Redis is said to be
// persistent, the epoch is missing and the caller never held slots: then
// it is taken for the budget's first use.
var slotsLua = redis.NewScript(clockLua + `
local limit, dur, prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local want, demand, holder = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local prior, had, persistent = tonumber(ARGV[7]), ARGV[8] == '1', ARGV[9] == '1'
local SET, DEM, EXP, META, HELD, ABOVE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local meta = redis.call('HMGET', META, 'epoch', 'frozen', 'until')
local epoch, frozen, due = tonumber(meta[1]), tonumber(meta[2]) or 0, tonumber(meta[3]) or 0
-- Leases that ran out, Limiters' and holders': their slots leave the set.
redis.call('ZREMRANGEBYSCORE', SET, '-inf', f(now))
local cache = redis.call('HMGET', HELD, ' total', ' level', ' extra', ' others')
local total, level, extra, lothers = tonumber(cache[1]) or 0, tonumber(cache[2]), tonumber(cache[3]), tonumber(cache[4])
local dirty = level == nil
-- Holders whose lease ran out.
local gone = redis.call('ZRANGEBYSCORE', EXP, '-inf', f(now))
if #gone > 0 then
  for _, g in ipairs(gone) do total = total - (tonumber(redis.call('HGET', HELD, g)) or 0) end
  redis.call('HDEL', HELD, unpack(gone))
  redis.call('HDEL', DEM, unpack(gone))
  redis.call('ZREM', ABOVE, unpack(gone))
  redis.call('ZREMRANGEBYSCORE', EXP, '-inf', f(now))
  dirty = true
end
-- Keys Redis dropped before they were due (holdersLost's test, on what
-- this script has read): the state is lost.
if epoch and ((not tonumber(cache[1]) and due > now) or redis.call('ZCARD', SET) < total) then
  redis.call('DEL', SET, DEM, EXP, HELD, ABOVE)
  epoch, had, due = nil, true, 0
  total, level, extra, lothers, dirty = 0, nil, nil, nil, true
end
if not epoch then
  epoch, frozen = now, 0
  if had or not persistent then frozen = now + dur end
  redis.call('HSET', META, 'epoch', f(epoch), 'frozen', f(frozen))
end
local freeze = frozen > now
local k = tonumber(redis.call('HGET', HELD, holder)) or 0
local old = tonumber(redis.call('HGET', DEM, holder)) or 0
if not dirty and math.min(old, level + 1) ~= math.min(demand, level + 1) then dirty = true end
if demand > 0 then
  redis.call('HSET', DEM, holder, demand)
else
  redis.call('HDEL', DEM, holder)
end
local others = redis.call('ZCARD', SET) - total
if others ~= lothers then dirty = true end
if dirty then
  -- Water-fill the room the Limiters leave, smallest demand first.
  local list = {}
  local h = redis.call('HGETALL', DEM)
  for i = 1, #h, 2 do list[#list + 1] = {h[i], tonumber(h[i + 1])} end
  table.sort(list, function(a, b) if a[2] ~= b[2] then return a[2] < b[2] end return a[1] < b[1] end)
  local rem, n = math.max(0, limit - others), #list
  level, extra = nil, 0
  redis.call('DEL', ABOVE)
  for i, e in ipairs(list) do
    if level == nil then
      local share = math.floor(rem / (n - i + 1))
      if e[2] <= share then
        rem = rem - e[2]
      else
        level = share
        extra = rem - share * (n - i + 1)
      end
    end
    if level ~= nil then redis.call('ZADD', ABOVE, 0, e[1]) end
  end
  if level == nil then level = limit end
  redis.call('HSET', HELD, ' level', level, ' extra', extra, ' others', others)
end
local fair = math.min(demand, level)
if demand > level and extra > 0 then
  local rank = redis.call('ZRANK', ABOVE, holder)
  if rank and rank < extra then fair = level + 1 end
end
-- This holder's slots: extras go, growth up to its fair share (or, while
-- frozen, its prior) and the budget's room.
while k > want do
  redis.call('ZREM', SET, prefix .. f(k))
  k, total = k - 1, total - 1
end
local cap = math.min(want, fair)
if freeze then cap = math.min(want, math.max(k, prior)) end
local room = limit - redis.call('ZCARD', SET)
if cap > k and room > 0 then
  local add = math.min(cap - k, room)
  k, total = k + add, total + add
end
local exp = f(now + dur)
for i = 1, k do redis.call('ZADD', SET, exp, prefix .. f(i)) end
if k > 0 or demand > 0 then
  redis.call('ZADD', EXP, exp, holder)
else
  redis.call('ZREM', EXP, holder)
end
if k > 0 then redis.call('HSET', HELD, holder, k) else redis.call('HDEL', HELD, holder) end
redis.call('HSET', HELD, ' total', total)
local ttl = math.ceil(dur / 1000) + 1
for _, key in ipairs({SET, DEM, EXP, HELD, ABOVE}) do
  if redis.call('EXISTS', key) == 1 and redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
-- When the counts are due to expire, written once an eighth of a lease:
-- the loss of keys is told within it, and a budget many holders renew
-- writes the epoch's key seldom.
if due < now + dur - dur / 8 then redis.call('HSET', META, 'until', exp) end
local left = 0
if freeze then left = frozen - now end
return {k, fair, epoch, left}
`)

// bucketClaimLua: KEYS[1] the bucket (see bucketLua); ARGV limit, tokens
// per period, period µs, tokens wanted. Returns {tokens taken, µs until the
// next token when none were, 0}: the last a sliding window's segment.
var bucketClaimLua = redis.NewScript(clockLua + bucketLua + `
local limit, per, period, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, last = bucket(limit, per, period)
local got = math.max(0, math.min(n, math.floor(tokens)))
tokens = tokens - got
saveBucket(limit, per, period, tokens, last)
if got > 0 then return {got, 0, 0} end
local wait = last + period - now
if wait < 1 then wait = 1 end
return {0, wait, 0}
`)

// bucketReturnLua: KEYS[1] the bucket; ARGV limit, tokens per period,
// period µs, tokens returned (and a sliding window's bound, unused).
// Returns {tokens added}: never above the limit.
// A full bucket is left as it is, and a missing one (full) is not created.
var bucketReturnLua = redis.NewScript(clockLua + bucketLua + `
local limit, per, period, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, last = bucket(limit, per, period)
local add = math.min(n, limit - tokens)
if add <= 0 then return {0} end
tokens = tokens + add
if tokens >= limit then last = now end
saveBucket(limit, per, period, tokens, last)
return {add}
`)

// windowClaimLua: KEYS[1] the sliding window (see windowLua); ARGV
// permits, segment µs, segments, permits wanted. Returns {permits taken, µs
// until the oldest counted segment leaves the window when none were, the
// current segment's id}: the one the permits were counted in, which a
// Return of them is bounded by.
var windowClaimLua = redis.NewScript(clockLua + windowLua + `
local limit, seg, n, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cur, total, oldest = window(seg, n)
local got = math.max(0, math.min(want, limit - total))
if got > 0 then
  redis.call('HINCRBY', KEYS[1], f(cur), got)
  keepWindow(cur, seg, n)
  return {got, 0, cur}
end
local wait = (oldest + n) * seg - now
if wait < 1 then wait = 1 end
return {0, wait, cur}
`)

// windowReturnLua: KEYS[1] the sliding window; ARGV permits, segment µs,
// segments, permits returned, bound (the segment the oldest of them was
// counted in). Subtracts them from the newest counted segments at or
// before bound, deleting those that reach zero (so that the oldest counted
// segment, which a refusal's wait is until, always counts something).
// Uncounting a permit in an older segment than its own leaves more counted
// later than there was, which is safe; in a newer one it would uncount
// another's permit, which then leaves the window early. Returns {permits
// subtracted}: never more than were counted at or before bound.
var windowReturnLua = redis.NewScript(clockLua + windowLua + `
local seg, n, left, bound = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local _, _, _, live = window(seg, n)
table.sort(live, function(a, b) return a[1] > b[1] end)
local back = 0
for _, s in ipairs(live) do
  if left <= 0 then break end
  if s[1] <= bound then
    local take = math.max(0, math.min(left, s[3]))
    if take >= s[3] then
      redis.call('HDEL', KEYS[1], s[2])
    else
      redis.call('HINCRBY', KEYS[1], s[2], -take)
    end
    left, back = left - take, back + take
  end
end
return {back}
`)

// runScript runs one of the scripts on keys and returns its reply, of want
// numbers. Redis's retryable replies (the script did not run) are retried
// DefaultMaxRetries more times with Limiter's backoff; a network error is
// never: a lost reply may have been applied (see evalSha). Any other
// failure is a *StoreError naming name and op, and a ctx that ends is
// returned as itself: cancellation stays cancellation.
func runScript(ctx context.Context, c redis.Scripter, script *redis.Script, name, op string, keys []string, want int, args ...any) ([]int64, error) {
	var vals []int64
	var err error
	for attempt := 0; ; attempt++ {
		vals, err = evalSha(ctx, c, script, keys, args).Int64Slice()
		if isNoScript(err) {
			// Not run: load it and run it again.
			if err = script.Load(ctx, c).Err(); err == nil {
				vals, err = evalSha(ctx, c, script, keys, args).Int64Slice()
			}
		}
		if err == nil || attempt >= DefaultMaxRetries || !retryable(err) || ctx.Err() != nil {
			break
		}
		if err := sleep(ctx, backoff(attempt)); err != nil {
			return nil, err
		}
	}
	if err == nil && len(vals) != want {
		err = errors.New("script returned " + strconv.Itoa(len(vals)) + " values, want " + strconv.Itoa(want))
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, &StoreError{Limiter: name, Op: op, Err: err}
	}
	return vals, nil
}

// noRetryCmd is a command the client sends once: a script whose reply was
// lost may have been applied, and a Return applied twice over-admits. A
// ClusterClient sends a call again after a lost reply (EOF, a timeout) up
// to MaxRedirects times, whatever MaxRetries says, unless the command says
// NoRetry; it still follows MOVED and ASK, which Redis sends without
// running the script.
type noRetryCmd struct{ *redis.Cmd }

func (noRetryCmd) NoRetry() bool { return true }

// processor is a client that sends a command as it is given.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// evalSha runs script by its hash on c (a client or a pipeline), as a
// noRetryCmd when c can send one.
func evalSha(ctx context.Context, c redis.Scripter, script *redis.Script, keys []string, args []any) *redis.Cmd {
	p, ok := c.(processor)
	if !ok {
		return script.EvalSha(ctx, c, keys, args...)
	}
	a := make([]any, 0, 3+len(keys)+len(args))
	a = append(a, "evalsha", script.Hash(), len(keys))
	for _, k := range keys {
		a = append(a, k)
	}
	cmd := redis.NewCmd(ctx, append(a, args...)...)
	cmd.SetFirstKeyPos(3)
	_ = p.Process(ctx, noRetryCmd{cmd})
	return cmd
}
