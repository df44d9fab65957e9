-- fence_sync: raise a node's fence counter to the fence a Redlock quorum granted, and
-- store it in the exclusive lock it was granted for (fence_sync_shared: in a share).
--
-- With several masters each node INCRs its own counter, so the granting nodes may
-- disagree. The client takes the largest value F and stores it back here; any later
-- quorum intersects this one, so its largest value is then greater than F.
--
-- KEYS[1]  lock     the lock hash
-- KEYS[2]  fence    the fence counter
-- ARGV[1]  token    owner token
-- ARGV[2]  granted  the fence F
--
-- Returns  1  the counter is >= F and this token holds the lock (its fence is now F)
--          0  the counter is >= F but the token no longer holds the lock
local token, granted = ARGV[1], ARGV[2]
local fence = store_fence(KEYS[2], granted)
if not fence then
    return redis.error_reply('ERR celery_redlock fence_sync: fence must be an integer')
end
if redis.call('HGET', KEYS[1], 'token') == token then
    redis.call('HSET', KEYS[1], 'fence', fence_text(fence))
    return 1
end
return 0
