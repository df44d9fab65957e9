-- unpark: the copy of a parked run is about to start its body: is it the run's copy,
-- and then it leaves the parked runs (take_due.lua no longer publishes it).
--
-- KEYS[1]  due      the parked runs' due times (sorted set: task id -> ms, node clock)
-- KEYS[2]  runs     the parked runs (hash: task id -> the run, JSON with its "token")
-- KEYS[3]  taken    how often each parked run was taken (hash: task id -> count)
-- KEYS[4]  started  copies started of runs taken more than once (sorted set: 'id:token' -> ms)
-- KEYS[5]  lines    the lines of runs waiting for a key's release (park.lua)
-- KEYS[6..7]  line*  optional, both or none: the run's hand-off mark (cleared: the next
--          run waiting for the key may be published once this one releases it), and the
--          line of its lock (the run leaves it; the line's next run is looked at from now)
-- ARGV[1]  task_id  the run's task id
-- ARGV[2]  token    the copy's token (from its message); '' for a delivery that is no parked
--          copy but a message given again by the broker (its worker died)
-- ARGV[3]  horizon_ms  horizon in ms: how long the start of a run taken more than once is kept,
--          for its other copies (one a dead worker held) to find
-- ARGV[4]  member   the copy's member in started: 'task id:token' ('' with no token)
--
-- Returns  1  start: this copy is the run's; its record is removed
--          0  do not start: a copy of this parking started already, or the run is
--             parked under another token (a later parking's copy will run), or
--             (token '') the run is parked: its parked copy will run
--          2  no record: start (the record expired, or the node lost it)
local task_id, token, member = ARGV[1], ARGV[2], ARGV[4]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock unpark: empty task id')
end
local horizon = tonumber(ARGV[3])
if not horizon or horizon <= 0 then
    return redis.error_reply('ERR celery_redlock unpark: horizon must be > 0 ms')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (now - horizon))
if token ~= '' and redis.call('ZSCORE', KEYS[4], member) then
    return 0
end
local record = redis.call('HGET', KEYS[2], task_id)
if not record then
    return 2
end
if token == '' or cjson.decode(record).token ~= token then
    return 0
end
local taken = tonumber(redis.call('HGET', KEYS[3], task_id) or '0')
redis.call('ZREM', KEYS[1], task_id)
local line = KEYS[7]
if line and redis.call('ZREM', line, task_id) == 1 then
    local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
    if first[2] then
        redis.call('ZADD', KEYS[5], math.max(now, tonumber(first[2])), line)
    else
        redis.call('ZREM', KEYS[5], line)
    end
end
redis.call('HDEL', KEYS[2], task_id)
redis.call('HDEL', KEYS[3], task_id)
if taken >= 2 then
    redis.call('ZADD', KEYS[4], now, member)
    redis.call('PEXPIRE', KEYS[4], horizon)
end
if KEYS[6] and redis.call('GET', KEYS[6]) == task_id then
    redis.call('DEL', KEYS[6])
end
return 1
