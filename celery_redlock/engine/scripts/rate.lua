-- rate: admit one start of a key under a budget of N starts per sliding window
-- (lock_rate, RateLimit), judged on this node's clock. A log of the starts, exact.
--
-- KEYS[1]  the key's starts (sorted set: member -> start time in ms, node clock)
-- ARGV[1]  N, the starts allowed per window (integer, 1 to 1000000)
-- ARGV[2]  the window in milliseconds (positive integer, at most 30 days)
-- ARGV[3]  this start's member (unique per admission: a token)
-- ARGV[4]  '' to admit; 'peek' to only count (writes nothing but the trim)
--
-- Returns  {1, used, 0}        admitted: the start is logged; used counts it
--          {0, used, wait_ms}  N starts in the last window: the oldest leaves it
--                              in wait_ms (at least 1)
--          {2, used, wait_ms}  peek: used now, and wait_ms until a start would be
--                              admitted (0: now)
-- A member logged already (the same admission sent again) is admitted again without a
-- second entry. The key expires one window after its last start: nothing of it
-- outlives its last use by more than one window.
local limit = tonumber(ARGV[1])
if not limit or limit < 1 or limit > 1000000 or limit ~= math.floor(limit) then
    return redis.error_reply('ERR celery_redlock rate: N must be an integer from 1 to 1000000')
end
local window = tonumber(ARGV[2])
if not window or window <= 0 or window > 2592000000 or window ~= math.floor(window) then
    return redis.error_reply('ERR celery_redlock rate: window must be a positive integer of ms, at most 30 days')
end
if ARGV[3] == nil or ARGV[3] == '' then
    return redis.error_reply('ERR celery_redlock rate: empty member')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local used = redis.call('ZCARD', KEYS[1])
local function wait_ms()
    -- The start that must leave the window before one more fits: the (used-N+1)th oldest.
    local oldest = redis.call('ZRANGE', KEYS[1], used - limit, used - limit, 'WITHSCORES')
    return math.max(1, tonumber(oldest[2]) + window - now)
end
if ARGV[4] == 'peek' then
    if used < limit then
        return {2, used, 0}
    end
    return {2, used, wait_ms()}
end
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
    return {1, used, 0}
end
if used >= limit then
    return {0, used, wait_ms()}
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return {1, used + 1, 0}
