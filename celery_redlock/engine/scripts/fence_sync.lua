-- fence_sync: raise a node's fence counter to the fence a Redlock quorum granted.
--
-- With several masters each node INCRs its own counter, so the granting nodes may
-- disagree. The client takes the largest value F and stores it back here; any later
-- quorum intersects this one, so its largest value is then greater than F.
--
-- KEYS[1]  lock hash     KEYS[2]  fence counter
-- KEYS[3]  shared holders' details (for a share: ARGV[3] = 's')
-- ARGV[1]  owner token   ARGV[2]  fence F   ARGV[3]  's' for a share, else ''
--
-- Returns  1  the counter is >= F and this token holds the lock (its fence is now F)
--          0  the counter is >= F but the token no longer holds the lock
local fence = tonumber(ARGV[2])
if not fence then
    return redis.error_reply('ERR celery_redlock fence_sync: fence must be an integer')
end
store_fence(KEYS[2], fence)
if ARGV[3] == 's' then
    local details = redis.call('HGET', KEYS[3], ARGV[1])
    if not details then
        return 0
    end
    local decoded = cjson.decode(details)
    decoded.fence = fence_text(fence)
    redis.call('HSET', KEYS[3], ARGV[1], cjson.encode(decoded))
    return 1
end
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
    redis.call('HSET', KEYS[1], 'fence', fence_text(fence))
    return 1
end
return 0
