-- fair_leave: a blocked waiter gives up its place in the record of waiters (a fair
-- lock's queue, or the record an exclusive lock's releases name waiters from).
--
-- Two scripts run this file, told apart by the prelude's NAMING (never by an
-- argument): fair_leave ('fair', for acquire_fair) and wake_leave ('wake', for
-- acquire_wake): how the next waiter is named (wake.lua).
--
-- KEYS[1]  lock      the lock hash
-- KEYS[2]  queue     the queue
-- KEYS[3]  waiting   the waiter deadlines
-- KEYS[4]  wake      the waiters' entries
-- KEYS[5]  channel   the lock's release channel
-- KEYS[6]  fence     the lock's fence counter (a grant's fence)
-- ARGV[1]  token       the waiter's token
-- ARGV[2]  reserve_ms  a positive number: the next waiter is granted the
--                      lock (as release.lua's); 0: it is only named
--
-- A waiter that holds the lock as it gives up (a release granted it, or its last try
-- was granted here but not by a quorum) releases it: the next waiter is named (or,
-- with nobody recorded, '' is published on the release channel). When the lock is
-- free, the oldest recorded waiter is named so that it does not wait for its next
-- refresh.
-- Returns  1  left the record    0  was not in it
local token, reserve_ms = ARGV[1], ARGV[2]
if token == nil or token == '' then
    return redis.error_reply('ERR celery_redlock fair_leave: empty owner token')
end
local reserve, wrong = naming_args(NAMING, reserve_ms)
if not reserve then
    return redis.error_reply('ERR celery_redlock fair_leave: ' .. wrong)
end
local lock, record, channel = KEYS[1], {KEYS[2], KEYS[3], KEYS[4]}, KEYS[5]
local left = redis.call('ZREM', KEYS[2], token)
forget(record, {token})
local held = redis.call('HGET', lock, 'token')
local passed_on = held == token
if passed_on then
    redis.call('DEL', lock)  -- held by this waiter, which leaves: free again
end
if passed_on or not held then
    local named = name_next(lock, KEYS[6], channel, record, NAMING, reserve, false)
    if not named and passed_on then
        redis.call('PUBLISH', channel, '')
    end
end
return left
