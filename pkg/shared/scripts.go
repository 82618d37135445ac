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

// concurrencyLua: KEYS[1] a sorted set of lease id → expiry µs, KEYS[2]
// the budget's epoch (see slotsLua); ARGV permits, lease µs, lease id.
// Expired leases are dropped before counting. While the budget's growth is
// frozen (holders of Slots taking back what their kernels hold after
// Redis lost the state) nothing is admitted, and the refusal says until
// when; the epoch is left to the holders to make.
var concurrencyLua = redis.NewScript(clockLua + `
local limit, dur = tonumber(ARGV[1]), tonumber(ARGV[2])
local frozen = tonumber(redis.call('HGET', KEYS[2], 'frozen')) or 0
if frozen > now then return {0, frozen - now, 0, 0} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', f(now))
local n = redis.call('ZCARD', KEYS[1])
if n < limit then
  redis.call('ZADD', KEYS[1], f(now + dur), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.ceil(dur / 1000) + 1)
  return {1, 0, limit - n - 1, 0}
end
return {0, 0, 0, 0}
`)

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
// demand, KEYS[3] a sorted set of holder → demand expiry µs, KEYS[4] the
// budget's epoch, a hash {epoch = µs it was made, frozen = µs growth is
// frozen until}; ARGV permits, lease µs, the holder's prefix (Holder +
// ":"), slots wanted, slots demanded, the holder, prior (slots the
// holder's kernel may still use), had (1: the holder held slots of this
// budget before), persistent (1: Redis keeps its state). Returns {slots
// held, fair share, epoch, µs growth stays frozen}.
//
// The holder's members are its prefix followed by digits only, so that
// holder "a" never counts holder "a:b"'s "a:b:1". Extras go from the
// highest numbers, and new slots take the lowest free ones, so the ids stay
// 1..held. The fair share is max-min: the permits not held by Limiters'
// leases, filled up from the smallest demand, equal parts to holders that
// demand more (ties in holder order, remainders to the later ones). A
// holder adds slots only up to its fair share, so a holder that demands
// little always gets it, and busy ones split the rest; one above its share
// is told so and gives slots back as its work drains. Key expiries are
// only ever raised: a shorter one would cut other holders' leases.
//
// The epoch tells a Redis that lost the budget's state (a restart without
// persistence, a failover to a replica without it) from one that kept it:
// it is made at first use and has no expiry. Missing, it is made anew, and
// growth is frozen for a lease on Redis's clock: holders' kernels may
// still hold connections on slots Redis forgot, and each may take back
// only its prior while the others come back. The freeze is skipped only
// when Redis is said to be persistent and the caller never held slots:
// then a missing epoch is the budget's first use.
var slotsLua = redis.NewScript(clockLua + `
local limit, dur, prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local want, demand, holder = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local prior, had, persistent = tonumber(ARGV[7]), ARGV[8] == '1', ARGV[9] == '1'
local meta = redis.call('HMGET', KEYS[4], 'epoch', 'frozen')
local epoch, frozen = tonumber(meta[1]), tonumber(meta[2]) or 0
if not epoch then
  epoch, frozen = now, 0
  if had or not persistent then frozen = now + dur end
  redis.call('HSET', KEYS[4], 'epoch', f(epoch), 'frozen', f(frozen))
end
local freeze = frozen > now
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', f(now))
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', f(now))
if #gone > 0 then
  redis.call('HDEL', KEYS[2], unpack(gone))
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', f(now))
end
if demand > 0 then
  redis.call('HSET', KEYS[2], holder, demand)
  redis.call('ZADD', KEYS[3], f(now + dur), holder)
else
  redis.call('HDEL', KEYS[2], holder)
  redis.call('ZREM', KEYS[3], holder)
end
local demands, list = {}, {}
local h = redis.call('HGETALL', KEYS[2])
for i = 1, #h, 2 do
  demands[h[i]] = tonumber(h[i + 1])
  list[#list + 1] = {h[i], tonumber(h[i + 1])}
end
local mine, had_ids, others = {}, {}, 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(m, 1, #prefix) == prefix and string.find(m, '^%d+$', #prefix + 1) then
    mine[#mine + 1] = m
    had_ids[m] = true
  else
    local owner = string.match(m, '^(.*):%d+$')
    if not (owner and demands[owner]) then others = others + 1 end
  end
end
table.sort(list, function(a, b) if a[2] ~= b[2] then return a[2] < b[2] end return a[1] < b[1] end)
local rem, fair = math.max(0, limit - others), 0
for i, e in ipairs(list) do
  local give = math.min(e[2], math.floor(rem / (#list - i + 1)))
  rem = rem - give
  if e[1] == holder then fair = give end
end
if #mine > want then
  local function num(m) return tonumber(string.sub(m, #prefix + 1)) end
  table.sort(mine, function(a, b) return num(a) < num(b) end)
  for i = #mine, want + 1, -1 do
    redis.call('ZREM', KEYS[1], mine[i])
    mine[i] = nil
  end
end
local cap = math.min(want, fair)
if freeze then cap = math.min(want, math.max(#mine, prior)) end
local total, i = redis.call('ZCARD', KEYS[1]), 0
while #mine < cap and total < limit do
  i = i + 1
  local id = prefix .. f(i)
  if not had_ids[id] then
    mine[#mine + 1] = id
    total = total + 1
  end
end
local exp = f(now + dur)
for _, m in ipairs(mine) do redis.call('ZADD', KEYS[1], exp, m) end
local ttl = math.ceil(dur / 1000) + 1
for k = 1, 3 do
  if redis.call('EXISTS', KEYS[k]) == 1 and redis.call('PTTL', KEYS[k]) < ttl then redis.call('PEXPIRE', KEYS[k], ttl) end
end
local left = 0
if freeze then left = frozen - now end
return {#mine, fair, epoch, left}
`)

// bucketClaimLua: KEYS[1] the bucket (see bucketLua); ARGV limit, tokens
// per period, period µs, tokens wanted. Returns {tokens taken, µs until the
// next token when none were}.
var bucketClaimLua = redis.NewScript(clockLua + bucketLua + `
local limit, per, period, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, last = bucket(limit, per, period)
local got = math.max(0, math.min(n, math.floor(tokens)))
tokens = tokens - got
saveBucket(limit, per, period, tokens, last)
if got > 0 then return {got, 0} end
local wait = last + period - now
if wait < 1 then wait = 1 end
return {0, wait}
`)

// bucketReturnLua: KEYS[1] the bucket; ARGV limit, tokens per period,
// period µs, tokens returned. Returns {tokens added}: never above the limit.
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
// until the oldest counted segment leaves the window when none were}.
var windowClaimLua = redis.NewScript(clockLua + windowLua + `
local limit, seg, n, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cur, total, oldest = window(seg, n)
local got = math.max(0, math.min(want, limit - total))
if got > 0 then
  redis.call('HINCRBY', KEYS[1], f(cur), got)
  keepWindow(cur, seg, n)
  return {got, 0}
end
local wait = (oldest + n) * seg - now
if wait < 1 then wait = 1 end
return {0, wait}
`)

// windowReturnLua: KEYS[1] the sliding window; ARGV permits, segment µs,
// segments, permits returned. Subtracts them from the newest counted
// segments first, deleting those that reach zero (so that the oldest counted
// segment, which a refusal's wait is until, always counts something).
// Returns {permits subtracted}: never more than were counted.
var windowReturnLua = redis.NewScript(clockLua + windowLua + `
local seg, n, left = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local _, _, _, live = window(seg, n)
table.sort(live, function(a, b) return a[1] > b[1] end)
local back = 0
for _, s in ipairs(live) do
  if left <= 0 then break end
  local take = math.max(0, math.min(left, s[3]))
  if take >= s[3] then
    redis.call('HDEL', KEYS[1], s[2])
  else
    redis.call('HINCRBY', KEYS[1], s[2], -take)
  end
  left, back = left - take, back + take
end
return {back}
`)

// runScript runs one of the scripts on keys and returns its reply, of want
// numbers. Redis's retryable replies (the script did not run) are retried
// DefaultMaxRetries more times with Limiter's backoff; network errors are
// left to the client's own retries, since a lost reply may have been
// applied. Any other failure is a *StoreError naming name and op, and a ctx
// that ends is returned as itself: cancellation stays cancellation.
func runScript(ctx context.Context, c redis.Scripter, script *redis.Script, name, op string, keys []string, want int, args ...any) ([]int64, error) {
	var vals []int64
	var err error
	for attempt := 0; ; attempt++ {
		vals, err = script.Run(ctx, c, keys, args...).Int64Slice()
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
