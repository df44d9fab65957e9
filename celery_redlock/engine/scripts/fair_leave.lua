-- fair_leave: a fair waiter gives up its place in the queue.
--
-- KEYS[1]  lock hash   KEYS[2]  queue   KEYS[3]  waiter deadlines   KEYS[4]  release channel
-- ARGV[1]  the waiter's token
--
-- When the lock is free, announces the new head of the queue on
-- KEYS[4] so that it does not wait for its next refresh.
-- Returns  1  left the queue    0  was not in it
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock fair_leave: empty owner token')
end
local left = redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
    local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if head then
        redis.call('PUBLISH', KEYS[4], head)
    end
end
return left
