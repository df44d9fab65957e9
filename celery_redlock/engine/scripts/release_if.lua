-- release_if: release the hold of this task id by this pid (its lock or its share).
--
-- Used by a prefork parent whose child died while running the task: the parent
-- never saw the child's token, but it knows the task id and the child's pid, and
-- the pair names one execution attempt (a redelivery of the same task id runs in
-- another process, or in the same process only after this one has ended).
--
-- KEYS[1]  lock        lock hash
-- KEYS[2]  channel     its release channel
-- KEYS[3]  shared      shared set (optional, with holders: shares too)
-- KEYS[4]  holders     shared holders' details
-- KEYS[5]  queue       optional, with waiting and wake: the record of blocked
--                      waiters, see wake.lua
-- KEYS[6]  waiting     waiter deadlines
-- KEYS[7]  wake        waiters' entries
-- KEYS[8]  fence       the lock's fence counter (a grant's fence), with the record
-- ARGV[1]  task_id     task id
-- ARGV[2]  pid         pid
-- ARGV[3]  reserve_ms  optional: a positive number grants the lock to the waiter named
--                      (0, the default: it is only named, and tries)
--
-- A deleted lock is announced as release_wake's does: the oldest recorded waiter is
-- granted the lock and told on its process channel; '' is published on
-- the channel when nobody is recorded, and for a share.
-- Returns  1  released
--          0  gone already
--         -1  held by another task or process: left alone
local task_id, pid, reserve_ms = ARGV[1], ARGV[2], ARGV[3]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock release_if: empty task id')
end
local reserve = ms_arg(reserve_ms or '0')
if not reserve then
    return redis.error_reply('ERR celery_redlock release_if: a reservation must be a non-negative integer of ms')
end
local holder = redis.call('HMGET', KEYS[1], 'task_id', 'pid', 'ttl')
if holder[1] ~= false then
    if holder[1] ~= task_id or holder[2] ~= pid then
        return -1
    end
    redis.call('DEL', KEYS[1])
    local named
    if #KEYS >= 8 then
        local lease_third = math.floor((tonumber(holder[3]) or 0) / 3)
        named = name_next(KEYS[1], KEYS[8], KEYS[2], {KEYS[5], KEYS[6], KEYS[7]}, 'wake',
                          math.min(reserve, lease_third), false)
    end
    if not named then
        redis.call('PUBLISH', KEYS[2], '')
    end
    return 1
end
if #KEYS >= 4 then
    local details = redis.call('HGETALL', KEYS[4])
    for j = 2, #details, 2 do
        local holder_details = cjson.decode(details[j])
        if holder_details.task_id == task_id and tostring(holder_details.pid) == pid then
            redis.call('ZREM', KEYS[3], details[j - 1])
            redis.call('HDEL', KEYS[4], details[j - 1])
            redis.call('PUBLISH', KEYS[2], '')
            return 1
        end
    end
end
return 0
