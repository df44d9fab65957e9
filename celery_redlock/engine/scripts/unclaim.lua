-- unclaim: free a send-time claim if this task id holds it.
--
-- Called when the claim's copy starts (``until_started``) or ends (``until_finished``),
-- is revoked, expires or is rejected; and by a sender that claimed on too few nodes.
--
-- KEYS[1]  claim    claim hash
-- ARGV[1]  task_id  task id
--
-- Returns  1  freed
--          0  gone already (freed, or expired)
--         -1  held by another task id: left alone
local task_id = ARGV[1]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock unclaim: empty task id')
end
local holder = redis.call('HGET', KEYS[1], 'task_id')
if not holder then
    return 0
end
if holder ~= task_id then
    return -1
end
redis.call('DEL', KEYS[1])
return 1
