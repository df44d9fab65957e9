-- release: delete the locks this token holds, and wake the waiters.
--
-- KEYS[2i-1]  lock hash of resource i (i = 1..n)   KEYS[2i]  its release channel
-- With fair waiting (ARGV[2] = 'fair', one resource): KEYS[3] queue, KEYS[4] waiter
--             deadlines; the announcement then names the head of the queue.
-- ARGV[1]     owner token
--
-- Publishes on KEYS[2i] for each lock it deletes: '' (wake one waiter
-- per process), or the token of the waiter whose turn it is (fair waiting).
-- A lock whose turn is over (field 'yield', see acquire.lua) is not deleted but
-- reserved: for 'yield' ms it is refused to the releasing process (its host and pid)
-- and free for any other, so that another process's woken waiter gets it.
-- Returns  1  released (every lock was held by this token)
--          0  gone already (expired or released), wholly or in part
--         -1  a lock is held by another token: that one is left alone
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release: empty owner token')
end
if ARGV[1] == YIELD_MARK then
    return redis.error_reply('ERR celery_redlock release: the owner token is the reservation mark')
end
local fair = ARGV[2] == 'fair'
local n = fair and 1 or #KEYS / 2
local released, taken = 0, false
for i = 1, n do
    local current = redis.call('HGET', KEYS[2 * i - 1], 'token')
    if current == ARGV[1] then
        local lock = KEYS[2 * i - 1]
        local held = redis.call('HMGET', lock, 'yield', 'host', 'pid', 'fence')
        local reserve = tonumber(held[1])
        redis.call('DEL', lock)
        if reserve and held[2] and held[3] then
            redis.call('HSET', lock, 'token', YIELD_MARK, 'host', held[2], 'pid', held[3],
                       'fence', held[4] or '0', 'ttl', reserve)
            redis.call('PEXPIRE', lock, reserve)
        end
        local message = ''
        if fair then
            message = redis.call('ZRANGE', KEYS[3], 0, 0)[1] or ''
        end
        redis.call('PUBLISH', KEYS[2 * i], message)
        released = released + 1
    elseif current then
        taken = true
    end
end
if taken then
    return -1
end
return released == n and 1 or 0
