-- note_started: a run that note_queued.lua recorded as waiting on the queue for its
-- keys starts: remove it from each.
--
-- KEYS[1..n]  queued*  the runs waiting on the queue for each key (see note_queued.lua)
-- ARGV[1]     task_id  the run's task id
--
-- Returns  1  removed
--          0  it was not recorded here
local task_id = ARGV[1]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock note_started: empty task id')
end
local removed = 0
for _, key in ipairs(KEYS) do
    removed = math.max(removed, redis.call('ZREM', key, task_id))
end
return removed
