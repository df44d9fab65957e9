-- beat_claim: the leading beat claims one run of a periodic entry before sending it.
--
-- Two checks in one step, so that no run is ever sent twice, even by a leader that was
-- paused past its lease and has not noticed yet:
--   1. the caller still holds the leader lock (its token is there);
--   2. no run of this entry later than the one the caller based its decision on has
--      been claimed (a compare-and-advance on the entry's last run time), and this run
--      is later than every claimed one: a run time is claimed once, whatever a
--      scheduler believes it last ran.
--
-- KEYS[1]  lock     leader lock hash
-- KEYS[2]  state    schedule state hash (entry -> last run, unix s)
-- ARGV[1]  token    leader token
-- ARGV[2]  entry    entry name
-- ARGV[3]  known    the last run the caller knows of (unix seconds; '' if none)
-- ARGV[4]  run_at   this run's time (unix seconds)
-- ARGV[5]  keep_ms  how long the state must last from now, in ms (a positive
--                   integer): past the entry's next run, so a new leader still knows
--                   this one; the state of a beat that is gone for good then expires.
--                   Only ever lengthened.
--
-- Returns  {1}                 claimed: send it
--          {0, stored}         this run or a later one was already claimed: do not send;
--                              adopt stored
--          {-1}                not the leader any more
local token, entry, known, run_at, keep_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('HGET', KEYS[1], 'token') ~= token then
    return {-1}
end
local stored = redis.call('HGET', KEYS[2], entry)
if stored and (known == '' or tonumber(stored) > tonumber(known)
               or tonumber(run_at) <= tonumber(stored)) then
    return {0, stored}
end
redis.call('HSET', KEYS[2], entry, run_at)
local keep = tonumber(keep_ms)
if keep and keep > 0 and redis.call('PTTL', KEYS[2]) < keep then
    redis.call('PEXPIRE', KEYS[2], keep)
end
return {1}
