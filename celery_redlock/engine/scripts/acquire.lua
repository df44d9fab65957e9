-- acquire: take an exclusive lock on one or more resources, all of them or none.
--
-- Four keys per resource i (taken together in one script, so no lock-order deadlock):
-- KEYS[4i-3]  lock hash (fields: token, fence, task_id, task_name, host, pid,
--             acquired_at, ttl)
-- KEYS[4i-2]  fence counter (next_fence, fence.lua: fences only grow for a resource,
--             and the counter expires a horizon after the last one)
-- KEYS[4i-1]  shared holders (sorted set token -> lease deadline, node clock, ms)
-- KEYS[4i]    shared holders' details (hash token -> json)
-- With fair waiting (one resource only) two more keys:
-- KEYS[5]     queue (sorted set token -> arrival)   KEYS[6]  waiter deadlines
-- Then, optional (the library always sends it): the lock's abandoned tokens
-- (abandon.lua), whose requests are refused
--
-- ARGV[1]  owner token (128 random bits, new for every acquisition)
-- ARGV[2]  lease in milliseconds (positive integer)
-- ARGV[3]  holder task id ('' when the holder is not a task)
-- ARGV[4]  holder host name      ARGV[5] holder pid
-- ARGV[6]  acquired-at, unix seconds on the client's clock (display only)
-- ARGV[7]  holder task name ('' when the holder is not a task)
-- ARGV[8]  '1': a blocking writer; if shared holders keep it out, mark it waiting
--          (WRITER_MARK in the shared set) so that no new shared holder gets in
-- ARGV[9]  fair waiting: '' off; else the waiter's lease in ms ('0': a try that
--          does not queue). Only the head of the queue may take a free lock.
-- ARGV[10] arrival order for the queue ('' : this node numbers arrivals)
-- ARGV[11..14] optional, all four: a handoff. ARGV[11] the token of the holder that
--          hands its locks over (a release in the same process); a lock it holds
--          counts as free, and is taken over in place (a new fence, the new holder's
--          fields), so it is never free in between for a third party to take.
--          ARGV[12], ARGV[13], ARGV[14]: the process's turn (non-negative integers).
--          Once a blocking attempt of another process (host, pid) was refused, the
--          holder's process may hand the lock over ARGV[12] more times, for at most
--          ARGV[13] ms; then a takeover is refused, and the lock's release reserves
--          it for ARGV[14] ms against that process (see release.lua).
--
-- Fields a turn keeps in the lock hash (a takeover keeps them, a release drops them):
--   waited    node ms when a blocking attempt of another process was first refused
--   handoffs  takeovers since then
--   yield     set when a takeover was refused: the reservation's length, in ms
-- A reservation is a lock hash with token YIELD_MARK and the yielding process's host
-- and pid: that process is refused (a blocking attempt of it marks 'waited', which the
-- next holder's turn inherits), anyone else takes it as free.
--
-- Returns  {1, fence_1, ..., fence_n}   acquired; fences are the new counter values
--          {2, fence_1, ..., fence_n}   this token held them already; leases refreshed
--          {0, wait_ms, holder_task}    kept out by another holder (or, fair, by the
--                                       queue); wait_ms: when that may change
--          {3}                          refused: this token's acquisition was
--                                       abandoned (nothing written)
if #ARGV ~= 10 and #ARGV ~= 14 then
    return redis.error_reply('ERR celery_redlock acquire: expected 10 or 14 arguments, got ' .. #ARGV)
end
local predecessor = ARGV[11]
if predecessor == '' or predecessor == ARGV[1] then
    predecessor = nil
end
local turn = {}
if #ARGV == 14 then
    for j = 12, 14 do
        local value = tonumber(ARGV[j])
        if not value or value < 0 or value > 2592000000 or value ~= math.floor(value) then
            return redis.error_reply('ERR celery_redlock acquire: a turn bound must be a non-negative integer')
        end
        turn[j - 11] = value
    end
end
-- Leases are capped at 30 days (settings.MAX_SECONDS): Lua hands a number of 1e14 or
-- more to Redis as '1e+14', which PEXPIRE refuses after the key was written.
local MAX_LEASE = 2592000000
local ttl = tonumber(ARGV[2])
if not ttl or ttl <= 0 or ttl > MAX_LEASE or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock acquire: lease must be a positive integer of ms, at most 30 days')
end
if ARGV[9] ~= nil and ARGV[9] ~= '' then
    local waiter_lease = tonumber(ARGV[9])
    if not waiter_lease or waiter_lease < 0 or waiter_lease > MAX_LEASE
            or waiter_lease ~= math.floor(waiter_lease) then
        return redis.error_reply('ERR celery_redlock acquire: fair waiter lease must be an integer of ms, 0 to 30 days')
    end
end
if ARGV[10] ~= nil and ARGV[10] ~= '' then
    -- Some Lua builds read 'nan' and 'inf' as numbers: ZADD would refuse them half-way.
    local arrival = tonumber(ARGV[10])
    if not arrival or arrival ~= arrival or arrival == math.huge or arrival == -math.huge then
        return redis.error_reply('ERR celery_redlock acquire: arrival order must be a finite number')
    end
end
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock acquire: empty owner token')
end
if ARGV[1] == YIELD_MARK then
    return redis.error_reply('ERR celery_redlock acquire: the owner token is the reservation mark')
end
local fair = ARGV[9] ~= nil and ARGV[9] ~= ''
local rest = #KEYS - (fair and 2 or 0)
local abandoned
if rest % 4 == 1 then
    abandoned = KEYS[#KEYS]
    rest = rest - 1
end
local n = rest / 4
if n < 1 or n ~= math.floor(n) or (fair and n ~= 1) then
    return redis.error_reply('ERR celery_redlock acquire: expected 4 keys per resource '
        .. '(and 2 queue keys with fair waiting, one resource only), then 1 optional')
end
local token = ARGV[1]
-- A request that arrives after its acquisition was abandoned (abandon.lua) grants
-- nothing and queues nowhere: nobody would hold or release it.
if abandoned and redis.call('ZSCORE', abandoned, token) then
    return {3}
end

local now
local function clock()
    if not now then
        local t = redis.call('TIME')
        now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    return now
end

-- Shared holders whose lease ended are dropped: a dead reader's share expires by itself.
local function shared_wait(shared, holders)
    if redis.call('EXISTS', shared) == 0 then
        return nil
    end
    local expired = redis.call('ZRANGEBYSCORE', shared, '-inf', clock())
    if #expired > 0 then
        redis.call('ZREMRANGEBYSCORE', shared, '-inf', clock())
        redis.call('HDEL', holders, unpack(expired))
    end
    local first = redis.call('ZRANGE', shared, 0, 1, 'WITHSCORES')
    for j = 1, #first, 2 do
        if first[j] ~= WRITER_MARK then
            return math.max(0, tonumber(first[j + 1]) - clock())
        end
    end
    return nil
end

-- The requester's process: the holder's own, or another (whose blocking attempts bound
-- the holder process's turn).
local function same_process(lock)
    local holder = redis.call('HMGET', lock, 'host', 'pid')
    return holder[1] == ARGV[4] and holder[2] == ARGV[5]
end

local blocked
local owned, mine, reserved, handed = 0, {}, {}, {}
for i = 1, n do
    local lock = KEYS[4 * i - 3]
    local current = redis.call('HGET', lock, 'token')
    if current == token then
        owned = owned + 1
        mine[i] = true
    elseif current == YIELD_MARK and not same_process(lock) then
        reserved[i] = true  -- reserved for anyone but the process that yielded it
    elseif current == YIELD_MARK then
        if ARGV[8] == '1' then
            redis.call('HSETNX', lock, 'waited', clock())  -- the next holder's turn is bounded
        end
        blocked = {0, redis.call('PTTL', lock), ''}
        break
    elseif current and current ~= predecessor then
        if ARGV[8] == '1' and not fair and not same_process(lock) then
            redis.call('HSETNX', lock, 'waited', clock())
        end
        blocked = {0, redis.call('PTTL', lock), redis.call('HGET', lock, 'task_id') or ''}
        break
    elseif current then
        -- A takeover: within the turn, or refused, and the release yields the lock.
        local waited = tonumber(redis.call('HGET', lock, 'waited'))
        if waited and (tonumber(redis.call('HGET', lock, 'handoffs') or '0') >= turn[1]
                       or clock() - waited >= turn[2]) then
            redis.call('HSET', lock, 'yield', math.max(1, turn[3]))
            blocked = {0, redis.call('PTTL', lock), redis.call('HGET', lock, 'task_id') or ''}
            break
        end
        handed[i] = waited ~= nil
    else
        local shared = KEYS[4 * i - 1]
        local wait = shared_wait(shared, KEYS[4 * i])
        if wait then
            if ARGV[8] == '1' then
                redis.call('ZADD', shared, clock() + ttl, WRITER_MARK)
                if redis.call('PTTL', shared) < ttl then
                    redis.call('PEXPIRE', shared, ttl)
                end
            end
            blocked = {0, wait, ''}
            break
        end
    end
end

if fair then
    local queue, waiting = KEYS[5], KEYS[6]
    local gone = redis.call('ZRANGEBYSCORE', waiting, '-inf', clock())
    if #gone > 0 then
        redis.call('ZREMRANGEBYSCORE', waiting, '-inf', clock())
        redis.call('ZREM', queue, unpack(gone))
    end
    if not blocked and owned < n then
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if head and head ~= token then
            local deadline = redis.call('ZSCORE', waiting, head)
            blocked = {0, math.max(0, tonumber(deadline or clock()) - clock()), ''}
        end
    end
    local waiter_ttl = tonumber(ARGV[9]) or 0
    if blocked and waiter_ttl > 0 then
        if not redis.call('ZSCORE', queue, token) then
            local arrival = tonumber(ARGV[10])
            if not arrival then
                local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')[2]
                arrival = math.max(clock(), (tonumber(last) or 0) + 1)
            end
            redis.call('ZADD', queue, arrival, token)
        end
        redis.call('ZADD', waiting, clock() + waiter_ttl, token)
        for _, key in ipairs({queue, waiting}) do
            if redis.call('PTTL', key) < waiter_ttl then
                redis.call('PEXPIRE', key, waiter_ttl)
            end
        end
    elseif not blocked then
        redis.call('ZREM', queue, token)
        redis.call('ZREM', waiting, token)
    end
end

if blocked then
    return blocked
end

local result = {owned == n and 2 or 1}
for i = 1, n do
    local lock = KEYS[4 * i - 3]
    local fence
    if mine[i] then
        fence = tonumber(redis.call('HGET', lock, 'fence'))
    else
        if reserved[i] then
            local asked = redis.call('HGET', lock, 'waited')
            redis.call('DEL', lock)
            if asked then  -- the yielding process waits already: this turn is bounded
                redis.call('HSET', lock, 'waited', clock())
            end
        elseif handed[i] then
            redis.call('HINCRBY', lock, 'handoffs', 1)
        end
        fence = next_fence(KEYS[4 * i - 2], ttl)
        redis.call('HSET', lock, 'token', token, 'fence', fence_text(fence), 'task_id', ARGV[3],
                   'task_name', ARGV[7] or '', 'host', ARGV[4], 'pid', ARGV[5],
                   'acquired_at', ARGV[6], 'ttl', ttl)
        redis.call('ZREM', KEYS[4 * i - 1], WRITER_MARK)
    end
    redis.call('PEXPIRE', lock, ttl)
    result[i + 1] = fence
end
return result
