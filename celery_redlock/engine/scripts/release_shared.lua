-- release_shared: give back one share (read lock or slot), and wake the waiters.
--
-- KEYS[1]  the lock's release channel   KEYS[2]  shared set
-- KEYS[3]  shared holders' details
-- ARGV[1]  owner token
--
-- Publishes '' on KEYS[1] when it removes the share.
-- Returns  1  released
--          0  gone already (expired, or dropped after expiring)
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release_shared: empty owner token')
end
if ARGV[1] == WRITER_MARK or redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then
    return 0
end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('PUBLISH', KEYS[1], '')
return 1
