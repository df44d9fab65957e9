-- note_queued: record that a run waits on the queue for its keys (lock_on_busy=
-- "requeue": a run put back because its key was busy). note_started.lua removes it
-- when it starts. Runs refused by their budget are recorded by rate.lua itself, in
-- their admission.
--
-- KEYS[1..n]  queued*   the runs waiting on the queue for each key (sorted sets: task
--                       id -> due time in ms on the node's clock; the library
--                       queued.lua)
-- ARGV[1]     task_id   the run's task id
-- ARGV[2]     delay_ms  ms from now until the run is due again
-- ARGV[3]     grace_ms  the grace in ms (keys.QUEUED_GRACE) after which an entry is
--                       dropped
--
-- Returns  1  recorded
local task_id, delay_ms, grace = ARGV[1], ARGV[2], grace_ms(ARGV[3])
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock note_queued: empty task id')
end
local delay = tonumber(delay_ms)
if not delay or delay < 0 or delay > 1000000000000 or delay ~= math.floor(delay) or not grace then
    return redis.error_reply('ERR celery_redlock note_queued: delay must be a whole number of ms >= 0, grace > 0')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, key in ipairs(KEYS) do
    queue_run(key, task_id, now + delay, now, grace)
end
return 1
