-- fair_leave: a blocked waiter gives up its place in the record of waiters (a fair
-- lock's queue, or the record an exclusive lock's releases name waiters from).
--
-- KEYS[1]  lock hash   KEYS[2]  queue   KEYS[3]  waiter deadlines
-- KEYS[4]  wake (process channels)   KEYS[5]  release channel
-- ARGV[1]  the waiter's token
-- ARGV[2]  'fair' (default) or 'wake': how the next waiter is named (wake.lua)
-- ARGV[3]  ('wake') the reservation for the waiter named, in ms (non-negative integer)
--
-- A waiter that a release named and that leaves instead of taking the lock passes
-- the reservation on, and one that holds the lock as it gives up (its last try was
-- granted here but not by a quorum) releases it: the next waiter is named (or, with
-- nobody recorded, '' is published on KEYS[5]). When the lock is free,
-- the oldest recorded waiter is named so that it does not wait for its next refresh.
-- Returns  1  left the record    0  was not in it
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock fair_leave: empty owner token')
end
local how = ARGV[2] or 'fair'
local reserve, wrong = naming_args(how, ARGV[3])
if not reserve then
    return redis.error_reply('ERR celery_redlock fair_leave: ' .. wrong)
end
local lock, record, channel = KEYS[1], {KEYS[2], KEYS[3], KEYS[4]}, KEYS[5]
local left = redis.call('ZREM', KEYS[2], ARGV[1])
forget(record, {ARGV[1]})
local held = redis.call('HMGET', lock, 'token', 'for', 'fence', 'ttl')
local passed_on = (held[1] == YIELD_MARK and held[2] == ARGV[1]) or held[1] == ARGV[1]
if passed_on then
    redis.call('DEL', lock)  -- kept for this waiter, which leaves: free again
    reserve = math.min(reserve, tonumber(held[4]) or 0)
end
if passed_on or not held[1] then
    local named = name_next(lock, channel, record, how, reserve, false, held[3] or '0')
    if not named and passed_on then
        redis.call('PUBLISH', channel, '')
    end
end
return left
