-- note_queued: record that a run waits on the queue for its keys, or that it left
-- (lock_on_busy="requeue": a run put back because its key was busy, then started).
-- Runs refused by their budget are recorded by rate.lua itself, in their admission.
--
-- KEYS[1..n]  the runs waiting on the queue for each key (sorted sets: task id -> due
--             time in ms on the node's clock; the library queued.lua)
-- ARGV[1]  the run's task id
-- ARGV[2]  ms from now until the run is due again; '' to remove the run (it starts)
-- ARGV[3]  the grace in ms (keys.QUEUED_GRACE) after which an entry is dropped
--
-- Returns  1  recorded (or removed)
--          0  removed: it was not recorded here
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock note_queued: empty task id')
end
if ARGV[2] == '' then
    local removed = 0
    for _, key in ipairs(KEYS) do
        removed = math.max(removed, redis.call('ZREM', key, ARGV[1]))
    end
    return removed
end
local delay, grace = tonumber(ARGV[2]), grace_ms(ARGV[3])
if not delay or delay < 0 or delay ~= math.floor(delay) or not grace then
    return redis.error_reply('ERR celery_redlock note_queued: delay must be a whole number of ms >= 0, grace > 0')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, key in ipairs(KEYS) do
    queue_run(key, ARGV[1], now + delay, now, grace)
end
return 1
