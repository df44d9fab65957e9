-- take_due: take the parked runs that are due (park.lua), each under a lease, for
-- this worker to publish; a run whose worker dies before its copy starts is due again
-- when the lease ends, and another worker takes it. Atomic: one worker takes a run.
--
-- KEYS[1]  due    the parked runs' due times (sorted set: task id -> ms, node clock),
--                 but for those waiting for a key's release
-- KEYS[2]  runs   the parked runs (hash: task id -> the run, JSON)
-- KEYS[3]  taken  how often each parked run was taken (hash: task id -> count)
-- KEYS[4]  lines  the lines of runs waiting for a key's release (sorted set: line -> ms
--                 when its first run is looked at next); a line is a sorted set of
--                 task id -> due ms (park.lua)
-- ARGV[1]  most        the most runs to take, and lines to look at (a bound on this call's
--          work)
-- ARGV[2]  lease_ms    the lease in ms: a run taken is due again that long after
-- ARGV[3]  recheck_ms  ms until a run waiting for a key that is still held is looked at
--          again, at least (a quarter of how long the lock has been held, at most
--          longest_ms)
-- ARGV[4]  handoff_ms  ms the hand-off mark of a key lasts (a run published for its release
--          has that long to start before the next one is published)
-- ARGV[5]  ahead_ms    a rate run in the due set (waiting for its slot alone) is taken that
--          many ms before it is due: its copy is published with a countdown to the slot
-- ARGV[6]  longest_ms  the longest wait before a run waiting for a held key is looked at again
--
-- Returns  {next_ms, id, run, taken, in_ms, ...}: next_ms the ms until the next run may
--          be taken (-1: none parked); then each run taken, its record, how often it
--          was taken (2 or more: an earlier copy may exist), and the ms until it is due
--          (0 but for a rate run taken ahead)
--
-- A run that waits for a key's release (its record has a "gate": the hand-off mark's
-- key, and "check", the lock key, or "shared" and "limit", the shared holders and how
-- many the lock allows) waits in its key's line, and only a line's first run is looked
-- at: it is taken when due, while the key is free and no other run was just handed it
-- (one run per release goes through the broker, not every waiting one). Its line is
-- looked at again a while later when the key is held. These keys are named in the
-- record and in lines, not in KEYS (they are the run's lock's): parking is for a
-- single Redis node or Redlock masters, not a Redis Cluster.
local most, lease, recheck, handoff = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ahead, longest = tonumber(ARGV[5]), tonumber(ARGV[6])
if not most or most < 1 or not lease or lease < 1 or not recheck or recheck < 1 or not handoff or handoff < 1 then
    return redis.error_reply('ERR celery_redlock take_due: counts and times must be positive')
end
if not ahead or ahead < 0 or not longest or longest < recheck then
    return redis.error_reply('ERR celery_redlock take_due: ahead_ms must be >= 0, longest_ms >= recheck_ms')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {-1}
local function take(id, record, at)
    local taken = redis.call('HINCRBY', KEYS[3], id, 1)
    out[#out + 1] = id
    out[#out + 1] = record
    out[#out + 1] = taken
    out[#out + 1] = math.max(0, at - now)
end
local function held_wait(lock)
    -- A quarter of how long the lock has been held since its last acquisition or
    -- renewal (its lease less the time left), from recheck_ms to longest_ms: a short
    -- hold is looked at again soon, a long one less and less often.
    local ttl = tonumber(redis.call('HGET', lock, 'ttl') or '')
    local left = redis.call('PTTL', lock)
    if not ttl or left < 0 then
        return recheck
    end
    return math.min(longest, math.max(recheck, math.floor((ttl - left) / 4)))
end
local function free_in(run)
    -- 0 if the run's key is free and nobody was just handed it, else the ms until
    -- its line is looked at again.
    if redis.call('EXISTS', run.gate) == 1 then
        return recheck
    elseif run.check and redis.call('EXISTS', run.check) == 1 then
        return held_wait(run.check)
    elseif run.shared and redis.call('ZCOUNT', run.shared, now, '+inf') >= (run.limit or 1) then
        return recheck
    end
    return 0
end
-- Runs waiting for nothing but their time.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + ahead, 'WITHSCORES', 'LIMIT', 0, most)
for i = 1, #due, 2 do
    local id, at = due[i], tonumber(due[i + 1])
    local record = redis.call('HGET', KEYS[2], id)
    if not record then
        redis.call('ZREM', KEYS[1], id)
    elseif at <= now or cjson.decode(record).kind == 'rate' then
        redis.call('ZADD', KEYS[1], now + lease, id)
        take(id, record, at)
    end
end
-- The first run of each line due to be looked at.
for _, line in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, most)) do
    local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
    local id, at = first[1], tonumber(first[2])
    local record = id and redis.call('HGET', KEYS[2], id)
    if not id then
        redis.call('ZREM', KEYS[4], line)
    elseif not record then
        redis.call('ZREM', line, id) -- its record is gone: the next run, at the next call
        redis.call('ZADD', KEYS[4], now, line)
    elseif at > now then
        redis.call('ZADD', KEYS[4], at, line)
    else
        local run = cjson.decode(record)
        local wait = free_in(run)
        if wait == 0 then
            redis.call('SET', run.gate, id, 'PX', handoff)
            redis.call('ZADD', line, now + lease, id)
            take(id, record, at)
            wait = recheck
        end
        redis.call('ZADD', KEYS[4], now + wait, line)
    end
end
local next_ms = -1
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if first[2] then
    -- A run further than ahead_ms may be a rate run, taken that much early (the caller
    -- looks again at least every idle period, so a rate run behind a later one of
    -- another kind is still taken ahead).
    local wait = tonumber(first[2]) - now
    next_ms = math.max(0, wait > ahead and wait - ahead or wait)
end
local line = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
if line[2] then
    local wait = math.max(0, tonumber(line[2]) - now)
    next_ms = next_ms < 0 and wait or math.min(next_ms, wait)
end
out[1] = next_ms
return out
