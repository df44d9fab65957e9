-- park: keep a run that must wait (its rate budget's slot, its key's release) in Redis
-- until it is due, for whichever worker is alive to publish it once (take_due.lua).
-- The message itself is acknowledged: no worker holds a copy while the run waits.
--
-- KEYS[1]  due       the parked runs' due times (sorted set: task id -> ms, node clock),
--                    but for those that wait for a key's release
-- KEYS[2]  runs      the parked runs (hash: task id -> the run, JSON)
-- KEYS[3]  taken     how often each parked run was taken (hash: task id -> count)
-- KEYS[4]  lines     the lines of runs waiting for a key's release (sorted set: line ->
--                    ms when take_due.lua next looks at its first run)
-- KEYS[5..6]  line*  optional, both or none: the hand-off mark of the run's lock
--                    (take_due.lua), cleared if it names this run (handed the key, it
--                    found it taken again: the next may go); and the line of the lock
--                    (sorted set: task id -> due ms), where the run waits if its record
--                    has a "gate" (it waits for the key's release)
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
--
-- Why lines: the runs waiting for one key go one at a time, at its releases, so only
-- the first of each line needs looking at; in the due set, every take would read them
-- all while the key is held.
local task_id, run = ARGV[1], ARGV[2]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock park: empty task id')
end
local delay, lifetime = tonumber(ARGV[3]), tonumber(ARGV[4])
if not delay or delay < 0 or delay > 1000000000000 or delay ~= math.floor(delay) or not lifetime or lifetime <= 0 or lifetime > 1000000000000 then
    return redis.error_reply('ERR celery_redlock park: delay must be whole ms >= 0, lifetime > 0')
end
local gate, line = KEYS[5], KEYS[6]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function look(at)
    -- take_due.lua looks at the line's first run by `at` (an earlier look stays).
    local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
    if not first[1] then
        redis.call('ZREM', KEYS[4], line)
        return
    end
    at = math.max(at, tonumber(first[2]))
    local current = tonumber(redis.call('ZSCORE', KEYS[4], line) or '')
    if not current or current > at then
        redis.call('ZADD', KEYS[4], at, line)
    end
end
local record = run
if run == '' then
    record = redis.call('HGET', KEYS[2], task_id)
    if not record then
        redis.call('ZREM', KEYS[1], task_id)
        if line then
            redis.call('ZREM', line, task_id)
            look(now)
        end
        return 0
    end
else
    redis.call('HSET', KEYS[2], task_id, run)
    redis.call('HDEL', KEYS[3], task_id)
end
local at = now + delay
local gated = line and cjson.decode(record).gate
if gated then
    redis.call('ZREM', KEYS[1], task_id)
    redis.call('ZADD', line, at, task_id)
else
    redis.call('ZADD', KEYS[1], at, task_id)
end
local freed = gate and redis.call('GET', gate) == task_id
if freed then
    redis.call('DEL', gate)
end
if gated or freed then
    look(now) -- its line has a new run, or may go on: looked at from now
end
-- Runs nobody took within their lifetime (no worker ran that long) are dropped, a
-- bounded number per call; a line is looked at every take while workers run.
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - lifetime), 'LIMIT', 0, 100)
for _, id in ipairs(stale) do
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
end
local idle = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - lifetime), 'LIMIT', 0, 10)
for _, old in ipairs(idle) do
    for _, id in ipairs(redis.call('ZRANGE', old, 0, 99)) do
        redis.call('ZREM', old, id)
        redis.call('HDEL', KEYS[2], id)
        redis.call('HDEL', KEYS[3], id)
    end
    if redis.call('EXISTS', old) == 0 then
        redis.call('ZREM', KEYS[4], old)
    end
end
local latest = at
for _, key in ipairs({KEYS[1], line}) do
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if last[2] then
        latest = math.max(latest, tonumber(last[2]))
    end
end
local keep = math.max(1, latest + lifetime - now)
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[3], KEYS[4], line}) do
    if redis.call('EXISTS', key) == 1 and redis.call('PTTL', key) < keep then
        redis.call('PEXPIRE', key, keep)
    end
end
return 1
