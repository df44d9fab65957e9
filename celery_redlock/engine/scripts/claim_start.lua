-- claim_start: a debounced copy is about to run: may it, and with which arguments?
--
-- Calls made while the copy was queued pushed its due time back and left their
-- arguments in the claim (claim.lua). The copy runs only once the due time has passed
-- and with the last call's arguments; otherwise it goes back on the queue with them.
-- Checking and freeing the claim are one step, so a call either lands in this run's
-- claim (and is run by it) or finds no claim and queues a new copy.
--
-- KEYS[1]  claim    claim hash
-- ARGV[1]  task_id  task id
-- ARGV[2]  args     the copy's own arguments, serialized as claim.lua got them
--
-- Returns  {1}                  run now; the claim is freed
--          {0, wait_ms, args}   not yet, or not with these arguments: requeue with args
--                               after wait_ms (0: at once); the claim stays
--          {-1}                 no claim of this task id (expired or taken over): run
local task_id, args = ARGV[1], ARGV[2]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock claim_start: empty task id')
end
if redis.call('HGET', KEYS[1], 'task_id') ~= task_id then
    return {-1}
end
local fields = redis.call('HMGET', KEYS[1], 'due', 'args')
local wait = 0
if fields[1] then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    wait = math.max(0, tonumber(fields[1]) - now)
end
if wait > 0 or (fields[2] and fields[2] ~= args) then
    return {0, wait, fields[2] or args}
end
redis.call('DEL', KEYS[1])
return {1}
