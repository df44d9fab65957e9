-- acquire_shared: take one share of a resource (a read lock, or one of `limit` slots).
--
-- Any number of shared holders (at most `limit` when it is > 0) may hold a resource
-- together, never while an exclusive holder has it. A writer waiting for the shared
-- holders to leave marks itself (WRITER_MARK in the shared set, see acquire.lua): new
-- shares are then refused, so a stream of readers cannot starve writers.
--
-- KEYS[1]  lock         lock hash (the exclusive holder)
-- KEYS[2]  fence        fence counter
-- KEYS[3]  shared       shared holders (sorted set token -> lease deadline, node
--                       clock, ms)
-- KEYS[4]  holders      shared holders' details (hash token -> json: fence, task_id,
--                       pid, ...)
-- KEYS[5]  abandoned    optional (the library always sends it): the lock's abandoned
--                       tokens (abandon.lua), whose requests are refused
-- ARGV[1]  token        owner token
-- ARGV[2]  ttl_ms       lease in milliseconds (positive integer)
-- ARGV[3]  limit        0: any number of shared holders
-- ARGV[4]  task_id      holder task id ('' when the holder is not a task; a task id
--                       that holds a share already is refused: a redelivered message
--                       must not overlap itself)
-- ARGV[5]  host         holder host
-- ARGV[6]  pid          holder pid
-- ARGV[7]  acquired_at  unix seconds on the client's clock (display only)
-- ARGV[8]  task_name    holder task name
-- ARGV[9]  attempt      this attempt's number (as acquire.lua's): the share records
--                       the largest that counted it, and the undo of an earlier one
--                       leaves it alone
--
-- Returns  {1, fence}                  acquired a share
--          {2, fence}                  this token held one already; lease refreshed
--          {0, wait_ms, holder_task}   kept out; wait_ms: when that may change
--          {3}                         refused: this token's acquisition was abandoned
if #ARGV ~= 9 then
    return redis.error_reply('ERR celery_redlock acquire_shared: expected 9 arguments, got ' .. #ARGV)
end
local token, ttl_ms, limit_text, task_id, host = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pid, acquired_at, task_name = ARGV[6], ARGV[7], ARGV[8]
local attempt = tonumber(ARGV[9])
if not attempt or attempt < 1 or attempt > 9007199254740991 or attempt ~= math.floor(attempt) then
    return redis.error_reply('ERR celery_redlock acquire_shared: the attempt number must be a positive integer')
end
-- Capped at 30 days, as in acquire.lua (PEXPIRE refuses what Lua writes as '1e+14').
local ttl = tonumber(ttl_ms)
if not ttl or ttl <= 0 or ttl > 2592000000 or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock acquire_shared: lease must be a positive integer of ms, at most 30 days')
end
local limit = tonumber(limit_text)
if not limit or limit < 0 or limit > 9007199254740991 or limit ~= math.floor(limit) then
    return redis.error_reply('ERR celery_redlock acquire_shared: limit must be an integer >= 0')
end
if token == nil or token == '' or token == WRITER_MARK then
    return redis.error_reply('ERR celery_redlock acquire_shared: bad owner token')
end
local lock, shared, holders = KEYS[1], KEYS[3], KEYS[4]
if KEYS[5] and redis.call('ZSCORE', KEYS[5], token) then
    return {3}
end

if redis.call('EXISTS', lock) == 1 then
    return {0, redis.call('PTTL', lock), redis.call('HGET', lock, 'task_id') or ''}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', shared, '-inf', now)
if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', shared, '-inf', now)
    redis.call('HDEL', holders, unpack(expired))
end

local function extend_keys()
    for _, key in ipairs({shared, holders}) do
        if redis.call('PTTL', key) < ttl then
            redis.call('PEXPIRE', key, ttl)
        end
    end
end

if redis.call('ZSCORE', shared, token) then
    redis.call('ZADD', shared, now + ttl, token)
    local stored = redis.call('HGET', holders, token)
    local details = cjson.decode(stored or '{"fence":0}')
    if stored and (tonumber(details.attempt) or 0) < attempt then
        details.attempt = attempt  -- this attempt counts it now: an earlier one's undo must leave it
        redis.call('HSET', holders, token, cjson.encode(details))
    end
    extend_keys()
    return {2, tonumber(details.fence)}
end
local writer = redis.call('ZSCORE', shared, WRITER_MARK)
if writer then
    return {0, math.max(0, tonumber(writer) - now), ''}
end
if task_id ~= '' then
    local details = redis.call('HGETALL', holders)
    for j = 2, #details, 2 do
        if cjson.decode(details[j]).task_id == task_id then
            local until_ms = redis.call('ZSCORE', shared, details[j - 1])
            return {0, math.max(0, tonumber(until_ms or now) - now), task_id}
        end
    end
end
if limit > 0 and redis.call('ZCARD', shared) >= limit then
    local first = redis.call('ZRANGE', shared, 0, 0, 'WITHSCORES')
    local holder = cjson.decode(redis.call('HGET', holders, first[1]) or '{}').task_id
    return {0, math.max(0, tonumber(first[2]) - now), holder or ''}
end
local fence = next_fence(KEYS[2], ttl)
redis.call('ZADD', shared, now + ttl, token)
redis.call('HSET', holders, token, cjson.encode({
    fence = fence_text(fence), task_id = task_id, host = host, pid = pid,
    acquired_at = acquired_at, task_name = task_name, ttl = ttl, attempt = attempt}))
extend_keys()
return {1, fence}
