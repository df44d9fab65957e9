-- release_if: release the hold of this task id by this pid (its lock or its share).
--
-- Used by a prefork parent whose child died while running the task: the parent
-- never saw the child's token, but it knows the task id and the child's pid, and
-- the pair names one execution attempt (a redelivery of the same task id runs in
-- another process, or in the same process only after this one has ended).
--
-- KEYS[1]  lock hash   KEYS[2]  its release channel
-- KEYS[3]  shared set, KEYS[4] shared holders' details (optional: shares too)
-- KEYS[5]  queue, KEYS[6] waiter deadlines, KEYS[7] wake (optional: the record of
--          blocked waiters, see wake.lua)
-- ARGV[1]  task id   ARGV[2]  pid
-- ARGV[3]  optional: the reservation for the waiter a release names, in ms (at most a
--          third of the released lease is used; default 0)
--
-- A deleted lock is announced as release.lua's 'wake' does: the oldest recorded
-- waiter is named on its process channel (and the lock reserved for it); '' is
-- published on KEYS[2] when nobody is recorded, and for a share.
-- Returns  1  released
--          0  gone already
--         -1  held by another task or process: left alone
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release_if: empty task id')
end
local reserve = ms_arg(ARGV[3] or '0')
if not reserve then
    return redis.error_reply('ERR celery_redlock release_if: a reservation must be a non-negative integer of ms')
end
local holder = redis.call('HMGET', KEYS[1], 'task_id', 'pid', 'fence', 'ttl')
if holder[1] ~= false then
    if holder[1] ~= ARGV[1] or holder[2] ~= ARGV[2] then
        return -1
    end
    redis.call('DEL', KEYS[1])
    local named
    if #KEYS >= 7 then
        local lease_third = math.floor((tonumber(holder[4]) or 0) / 3)
        named = name_next(KEYS[1], KEYS[2], {KEYS[5], KEYS[6], KEYS[7]}, 'wake',
                          math.min(reserve, lease_third), false, holder[3] or '0')
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
        if holder_details.task_id == ARGV[1] and tostring(holder_details.pid) == ARGV[2] then
            redis.call('ZREM', KEYS[3], details[j - 1])
            redis.call('HDEL', KEYS[4], details[j - 1])
            redis.call('PUBLISH', KEYS[2], '')
            return 1
        end
    end
end
return 0
