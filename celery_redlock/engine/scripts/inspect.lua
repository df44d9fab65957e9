-- inspect: one consistent snapshot of a lock.
--
-- KEYS[1]  lock   lock hash
-- KEYS[2]  fence  fence counter
--
-- Returns  {pttl, fence_counter, field1, value1, field2, value2, ...}
--          pttl is -2 when the lock is free; fence_counter is 0 before the first use
local snapshot = {redis.call('PTTL', KEYS[1]), tonumber(redis.call('GET', KEYS[2]) or '0')}
for _, item in ipairs(redis.call('HGETALL', KEYS[1])) do
    snapshot[#snapshot + 1] = item
end
return snapshot
