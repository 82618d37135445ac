package shared

import "github.com/redis/go-redis/v9"

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

// slidingWindowLua: KEYS[1] a hash of segment id → permits counted in it;
// ARGV permits, segment µs, segments.
var slidingWindowLua = redis.NewScript(clockLua + `
local limit, seg, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = math.floor(now / seg)
local h = redis.call('HGETALL', KEYS[1])
local total, oldest = 0, cur
for i = 1, #h, 2 do
  local id = tonumber(h[i])
  if id + n <= cur then
    redis.call('HDEL', KEYS[1], h[i])
  else
    total = total + tonumber(h[i + 1])
    if id < oldest then oldest = id end
  end
end
if total < limit then
  redis.call('HINCRBY', KEYS[1], f(cur), 1)
  redis.call('PEXPIRE', KEYS[1], math.ceil(((cur + n) * seg - now) / 1000) + 1)
  return {1, 0, limit - total - 1, cur}
end
local wait = (oldest + n) * seg - now
if wait < 1 then wait = 1 end
return {0, wait, 0, cur}
`)

// tokenBucketLua: KEYS[1] a hash {t = tokens, l = time of the latest
// refill, µs}; ARGV limit, tokens per period, period µs. A missing bucket is
// full. The key expires when the bucket would be full again.
var tokenBucketLua = redis.NewScript(clockLua + `
local limit, per, period = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
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
local ok = 0
if tokens >= 1 then tokens, ok = tokens - 1, 1 end
redis.call('HSET', KEYS[1], 't', f(tokens), 'l', f(last))
local full = last + math.ceil((limit - tokens) / per) * period - now
local ttl = math.ceil(full / 1000) + 1
if ttl < 1 then ttl = 1 end
redis.call('PEXPIRE', KEYS[1], ttl)
if ok == 1 then return {1, 0, tokens, 0} end
local wait = last + period - now
if wait < 1 then wait = 1 end
return {0, wait, 0, 0}
`)

// concurrencyLua: KEYS[1] a sorted set of lease id → expiry µs; ARGV
// permits, lease µs, lease id. Expired leases are dropped before counting.
var concurrencyLua = redis.NewScript(clockLua + `
local limit, dur = tonumber(ARGV[1]), tonumber(ARGV[2])
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
