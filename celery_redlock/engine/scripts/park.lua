-- park: keep a run that must wait (its rate budget's slot, its key's release) in Redis
-- until it is due, for whichever worker is alive to publish it once (take_due.lua).
-- The message itself is acknowledged: no worker holds a copy while the run waits.
--
-- KEYS[1]  due       the parked runs' due times (sorted set: task id -> ms, node clock)
-- KEYS[2]  runs      the parked runs (hash: task id -> the run, JSON, opaque here)
-- KEYS[3]  taken     how often each parked run was taken (hash: task id -> count)
-- KEYS[4]  gate*     the hand-off mark of the run's lock (take_due.lua); optional:
--                    cleared if it names this run (handed the key, it found it taken again: the next may go)
-- ARGV[1]  task_id   the run's task id
-- ARGV[2]  run       the run (JSON); '' to put back a run already parked (taken, then refused
--          again by the budget before it was published: it keeps its record)
-- ARGV[3]  delay_ms  ms from now until the run is due (whole, >= 0)
-- ARGV[4]  lifetime_ms  lifetime in ms: how long after its due a run nobody takes is kept (no
--          worker alive); the keys expire that long after the latest due
--
-- Returns  1  parked
--          0  run was '' and the run is parked no more (its copy started, or
--             its record expired): nothing written
-- A run parked anew (run given) replaces its earlier record and take count.
local task_id, run = ARGV[1], ARGV[2]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock park: empty task id')
end
local delay, lifetime = tonumber(ARGV[3]), tonumber(ARGV[4])
if not delay or delay < 0 or delay > 1000000000000 or delay ~= math.floor(delay) or not lifetime or lifetime <= 0 or lifetime > 1000000000000 then
    return redis.error_reply('ERR celery_redlock park: delay must be whole ms >= 0, lifetime > 0')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if run == '' then
    if redis.call('HEXISTS', KEYS[2], task_id) == 0 then
        redis.call('ZREM', KEYS[1], task_id)
        return 0
    end
else
    redis.call('HSET', KEYS[2], task_id, run)
    redis.call('HDEL', KEYS[3], task_id)
end
redis.call('ZADD', KEYS[1], now + delay, task_id)
if KEYS[4] and redis.call('GET', KEYS[4]) == task_id then
    redis.call('DEL', KEYS[4])
end
-- Runs nobody took within their lifetime (no worker ran that long) are dropped, a
-- bounded number per call.
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - lifetime), 'LIMIT', 0, 100)
for _, id in ipairs(stale) do
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local keep = math.max(1, tonumber(last[2]) + lifetime - now)
for i = 1, 3 do
    if redis.call('PTTL', KEYS[i]) < keep then
        redis.call('PEXPIRE', KEYS[i], keep)
    end
end
return 1
