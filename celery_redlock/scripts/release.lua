-- release: delete the lock if this token holds it, and wake the waiters.
--
-- KEYS[1]  lock hash
-- ARGV[1]  owner token
--
-- Publishes '' on KEYS[1] .. ':released' when it deletes the lock.
-- Returns  1  released
--          0  gone already (expired or released)
--         -1  held by another token: left alone
local current = redis.call('HGET', KEYS[1], 'token')
if current == false then
    return 0
end
if current ~= ARGV[1] then
    return -1
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', KEYS[1] .. ':released', '')
return 1
