-- release_shared: give back one share (read lock or slot), and wake the waiters.
--
-- KEYS[1]  channel  the lock's release channel
-- KEYS[2]  shared   shared set
-- KEYS[3]  holders  shared holders' details
-- ARGV[1]  token    owner token
-- ARGV[2]  attempt  '' (or absent) for a release. Else the undo of an acquisition
--                   attempt, by its number: the share is given back only if no later
--                   attempt of the token counted it (acquire_shared)
--
-- Publishes '' on the channel when it removes the share.
-- Returns  1  released
--          0  gone already (expired, or dropped after expiring)
local token, attempt = ARGV[1], ARGV[2]
if token == nil or token == '' then
    return redis.error_reply('ERR celery_redlock release_shared: empty owner token')
end
if token == WRITER_MARK then
    return 0
end
if attempt ~= nil and attempt ~= '' then
    local undo = tonumber(attempt)
    if not undo or undo < 1 or undo > 9007199254740991 or undo ~= math.floor(undo) then
        return redis.error_reply('ERR celery_redlock release_shared: an attempt number must be a positive integer')
    end
    local details = redis.call('HGET', KEYS[3], token)
    if details and (tonumber(cjson.decode(details).attempt) or 0) > undo then
        return 0  -- counted by a later attempt of this token
    end
end
if redis.call('ZREM', KEYS[2], token) == 0 then
    return 0
end
redis.call('HDEL', KEYS[3], token)
redis.call('PUBLISH', KEYS[1], '')
return 1
