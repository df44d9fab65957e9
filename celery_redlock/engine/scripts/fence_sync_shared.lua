-- fence_sync_shared: raise a node's fence counter to the fence a Redlock quorum
-- granted a share, and store it in the share's details (fence_sync.lua: for an
-- exclusive lock, whose header says why).
--
-- KEYS[1]  fence    the fence counter
-- KEYS[2]  holders  the shared holders' details (hash token -> json)
-- ARGV[1]  token    owner token
-- ARGV[2]  granted  the fence F
--
-- Returns  1  the counter is >= F and this token holds a share (its fence is now F)
--          0  the counter is >= F but the token no longer holds a share
local token, granted = ARGV[1], ARGV[2]
local fence = store_fence(KEYS[1], granted)
if not fence then
    return redis.error_reply('ERR celery_redlock fence_sync: fence must be an integer')
end
local details = redis.call('HGET', KEYS[2], token)
if not details then
    return 0
end
local decoded = cjson.decode(details)
decoded.fence = fence_text(fence)
redis.call('HSET', KEYS[2], token, cjson.encode(decoded))
return 1
