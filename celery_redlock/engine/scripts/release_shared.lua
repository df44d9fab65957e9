-- release_shared: give back one share (read lock or slot), and wake the waiters.
--
-- KEYS[1]  the lock's release channel   KEYS[2]  shared set
-- KEYS[3]  shared holders' details
-- ARGV[1]  owner token
-- ARGV[2]  optional: the undo of an acquisition attempt, by its number: the share is
--          given back only if no later attempt of the token counted it (acquire_shared)
--
-- Publishes '' on KEYS[1] when it removes the share.
-- Returns  1  released
--          0  gone already (expired, or dropped after expiring)
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release_shared: empty owner token')
end
if ARGV[1] == WRITER_MARK then
    return 0
end
if ARGV[2] ~= nil and ARGV[2] ~= '' then
    local undo = tonumber(ARGV[2])
    if not undo or undo < 1 or undo ~= math.floor(undo) then
        return redis.error_reply('ERR celery_redlock release_shared: an attempt number must be a positive integer')
    end
    local details = redis.call('HGET', KEYS[3], ARGV[1])
    if details and (tonumber(cjson.decode(details).attempt) or 0) > undo then
        return 0  -- counted by a later attempt of this token
    end
end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then
    return 0
end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('PUBLISH', KEYS[1], '')
return 1
