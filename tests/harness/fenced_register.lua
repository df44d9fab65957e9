-- fenced_register.lua: a storage register that refuses writes carrying a stale fence.
--
-- It stands for the database a task writes to with its lock's fencing token
-- (DESIGN §3.5): a write is accepted only if its fence is larger than every fence
-- accepted so far for that key, or equal to it and from the same writer (one
-- critical section writing several times). Every attempt is logged, accepted or
-- not, so the history checker can verify the register as well as the lock.
--
-- KEYS[1]  hash of the register: fields "fence" (largest accepted) and "writer"
-- KEYS[2]  list: the log, one "<1|0> <fence> <writer>" entry per attempt
-- ARGV[1]  the writer's fence (a non-negative integer)
-- ARGV[2]  the writer: an id unique to one critical section
-- Returns  1 if the write was accepted, 0 if it was refused as stale;
--          an error reply if ARGV[1] is not an integer.
local fence = tonumber(ARGV[1])
if fence == nil or fence ~= math.floor(fence) or fence < 0 then
    return redis.error_reply('fenced_register: fence must be a non-negative integer')
end
local current = redis.call('HMGET', KEYS[1], 'fence', 'writer')
local largest = tonumber(current[1])
local accepted = largest == nil or fence > largest
    or (fence == largest and current[2] == ARGV[2])
-- Written as given: a fence (microseconds of a node's clock) has more digits than a Lua
-- number prints (1.7956892548114e+15).
if accepted then
    redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'writer', ARGV[2])
end
redis.call('RPUSH', KEYS[2], (accepted and '1' or '0') .. ' ' .. ARGV[1] .. ' ' .. ARGV[2])
return accepted and 1 or 0
