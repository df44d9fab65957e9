-- release_if: delete the lock if it is held for this task id by this pid.
--
-- Used by a prefork parent whose child died while running the task: the parent
-- never saw the child's token, but it knows the task id and the child's pid, and
-- the pair names one execution attempt (a redelivery of the same task id runs in
-- another process, or in the same process only after this one has ended).
--
-- KEYS[1]  lock hash
-- ARGV[1]  task id   ARGV[2]  pid
--
-- Publishes '' on KEYS[1] .. ':released' when it deletes the lock.
-- Returns  1  released
--          0  gone already
--         -1  held by another task or process: left alone
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release_if: empty task id')
end
local holder = redis.call('HMGET', KEYS[1], 'task_id', 'pid')
if holder[1] == false then
    return 0
end
if holder[1] ~= ARGV[1] or holder[2] ~= ARGV[2] then
    return -1
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[1] .. ':released', '')
return 1
