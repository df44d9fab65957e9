-- acquire: take an exclusive lock on one or more resources, all of them or none.
--
-- Three scripts run this file, told apart by the prelude's NAMING (never by an
-- argument): acquire ('': any number of resources, no record of waiters),
-- acquire_wake and acquire_fair (one resource, with a record of its blocked waiters,
-- see wake.lua). 'wake': anyone may take a free lock (a release grants it to the
-- oldest recorded waiter, so it is free only when nobody waits). 'fair': only the head
-- of the queue may take a free lock.
--
-- KEYS[1..4n]  resources*  four keys per resource (taken together in one script, so
--             no lock-order deadlock): the lock hash (fields: token, attempt, fence,
--             task_id, task_name, host, pid, acquired_at, ttl), the fence counter
--             (next_fence, fence.lua: fences only grow for a resource, and the counter
--             expires a horizon after the last one), the shared holders (sorted set
--             token -> lease deadline, node clock, ms) and their details (hash token ->
--             json)
-- KEYS[..]    record*   with a record (one resource): queue (sorted set token ->
--             arrival), waiter deadlines, wake (hash token -> the waiter's process
--             channel); none for acquire
-- KEYS[..]    abandoned  optional (the library always sends it): the lock's abandoned
--             tokens (abandon.lua), whose requests are refused
--
-- ARGV[1]   token       owner token (128 random bits, new for every acquisition)
-- ARGV[2]   ttl_ms      lease in milliseconds (positive integer)
-- ARGV[3]   task_id     holder task id ('' when the holder is not a task)
-- ARGV[4]   host        holder host name
-- ARGV[5]   pid         holder pid
-- ARGV[6]   acquired_at  unix seconds on the client's clock (display only)
-- ARGV[7]   task_name   holder task name ('' when the holder is not a task)
-- ARGV[8]   blocking    '1': a blocking writer; if shared holders keep it out, mark it
--                       waiting (WRITER_MARK in the shared set) so that no new shared
--                       holder gets in
-- ARGV[9]   waiter_ms   with a record: how long, in ms, a refused blocking requester
--                       keeps its place unless it refreshes it ('0': a try, which is
--                       never recorded); ignored without
-- ARGV[10]  arrival     arrival order for the queue ('' : this node numbers arrivals)
-- ARGV[11]  channel     the requester's process channel, recorded with its place
--                       ('' : none)
-- ARGV[12]  attempt     this attempt's number: the attempts of one acquisition share
--                       its token and are numbered 1, 2, ...; a lock written or found
--                       held by the token records the largest number that counted it
--                       (field 'attempt'), and the undo of an earlier attempt leaves it
--                       alone (release.lua), however late that undo arrives.
-- ARGV[13]  grant_ms    with a record and a channel: the lease, in ms, of a grant to
--                       this waiter by a release (wake.lua), recorded with its place
--                       (positive integer); else ignored
-- ARGV[14..17]  handoff*  optional, all four or none: a handoff. The token of the
--                       holder that hands its locks over (a release in the same
--                       process): a lock it holds counts as free, and is taken over in
--                       place (a new fence, the new holder's fields), so it is never
--                       free in between for a third party to take. Then the process's
--                       turn (non-negative integers): once a blocking attempt of
--                       another process (host, pid) was refused, the holder's process
--                       may hand the lock over that many more times, for at most that
--                       many ms; then a takeover is refused, and the lock's release
--                       reserves it for the last one's ms against that process (see
--                       release.lua).
--
-- Fields a turn keeps in the lock hash (a takeover keeps them, a release drops them):
--   waited    node ms when a blocking attempt of another process was first refused
--             (or, with a record, when the lock was granted while a waiter of another
--             process was recorded: it waits without asking again)
--   handoffs  takeovers since then
--   yield     set when a takeover was refused: the reservation's length, in ms
-- A reservation is a lock hash with token YIELD_MARK and the yielding process's host
-- and pid: that process is refused (a blocking attempt of it marks 'waited', which the
-- next holder's turn inherits), anyone else takes it as free.
--
-- Returns  {1, fence_1, ..., fence_n}   acquired; fences are the new counter values
--          {2, fence_1, ..., fence_n}   this token held them already; leases refreshed
--          {0, wait_ms, holder_task}    kept out by another holder (or a reservation,
--                                       or, fair, by the queue); wait_ms: when that
--                                       may change
--          {3}                          refused: this token's acquisition was
--                                       abandoned (nothing written)
if #ARGV ~= 13 and #ARGV ~= 17 then
    return redis.error_reply('ERR celery_redlock acquire: expected 13 or 17 arguments, got ' .. #ARGV)
end
local token, ttl_ms, task_id, host, pid = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local acquired_at, task_name, blocking, waiter_ms = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local arrival, channel = ARGV[10], ARGV[11]
local attempt = tonumber(ARGV[12])
if not attempt or attempt < 1 or attempt > 9007199254740991 or attempt ~= math.floor(attempt) then
    return redis.error_reply('ERR celery_redlock acquire: the attempt number must be a positive integer')
end
local grant_ms = ARGV[13]
local predecessor = #ARGV == 17 and ARGV[14] or ''
if predecessor == '' or predecessor == token then
    predecessor = nil
end
local turn = {}
if #ARGV == 17 then
    for j = 15, 17 do
        local value = tonumber(ARGV[j])
        if not value or value < 0 or value > 2592000000 or value ~= math.floor(value) then
            return redis.error_reply('ERR celery_redlock acquire: a turn bound must be a non-negative integer')
        end
        turn[j - 14] = value
    end
end
-- Leases are capped at 30 days (settings.MAX_SECONDS): Lua hands a number of 1e14 or
-- more to Redis as '1e+14', which PEXPIRE refuses after the key was written.
local MAX_LEASE = 2592000000
local ttl = tonumber(ttl_ms)
if not ttl or ttl <= 0 or ttl > MAX_LEASE or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock acquire: lease must be a positive integer of ms, at most 30 days')
end
local record = NAMING ~= ''
if record then
    local waiter_lease = tonumber(waiter_ms)
    if not waiter_lease or waiter_lease < 0 or waiter_lease > MAX_LEASE
            or waiter_lease ~= math.floor(waiter_lease) then
        return redis.error_reply('ERR celery_redlock acquire: the place of a waiter must last an integer of ms, 0 to 30 days')
    end
    local grant = ms_arg(grant_ms)
    if channel ~= '' and (not grant or grant < 1) then
        return redis.error_reply('ERR celery_redlock acquire: a grant must last a positive integer of ms, at most 30 days')
    end
end
if arrival ~= nil and arrival ~= '' then
    -- Some Lua builds read 'nan' and 'inf' as numbers: ZADD would refuse them half-way.
    local order = tonumber(arrival)
    if not order or order ~= order or order == math.huge or order == -math.huge then
        return redis.error_reply('ERR celery_redlock acquire: arrival order must be a finite number')
    end
end
if token == nil or token == '' then
    return redis.error_reply('ERR celery_redlock acquire: empty owner token')
end
if token == YIELD_MARK then
    return redis.error_reply('ERR celery_redlock acquire: the owner token is the reservation mark')
end
local fair = NAMING == 'fair'
local rest = #KEYS - (record and 3 or 0)
local abandoned
if rest % 4 == 1 then
    abandoned = KEYS[#KEYS]
    rest = rest - 1
end
local n = rest / 4
if n < 1 or n ~= math.floor(n) or (record and n ~= 1) then
    return redis.error_reply('ERR celery_redlock acquire: expected 4 keys per resource '
        .. '(and 3 record keys with a record of waiters, one resource only), then 1 optional')
end
-- A request that arrives after its acquisition was abandoned (abandon.lua) grants
-- nothing and queues nowhere: nobody would hold or release it.
if abandoned and redis.call('ZSCORE', abandoned, token) then
    return {3}
end

local now
local function clock()  -- the node's clock, read once
    now = now or node_ms()
    return now
end

-- Shared holders whose lease ended are dropped: a dead reader's share expires by itself.
local function shared_wait(shared, holders)
    if redis.call('EXISTS', shared) == 0 then
        return nil, true
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

-- A blocking attempt of another process than the holder's (or the next holder's)
-- bounds that holder's turn: the first one marks when ('waited').
local function mark_waited(lock, held)
    if not held[5] then
        redis.call('HSET', lock, 'waited', clock())
    end
end

local blocked
local owned, mine, reserved, handed, no_shares = 0, {}, {}, {}, {}
for i = 1, n do
    local lock = KEYS[4 * i - 3]
    -- One read of what a refusal needs (a call each would be four calls).
    local held = redis.call('HMGET', lock, 'token', 'host', 'pid', 'task_id', 'waited')
    local current = held[1]
    local same_process = held[2] == host and held[3] == pid
    if current == token then
        -- Held by this token: granted to an earlier attempt, or by a release (wake.lua).
        owned = owned + 1
        mine[i] = true
    elseif current == YIELD_MARK then
        if same_process then
            -- Refused: yielded by this process to the others.
            if blocking == '1' then
                mark_waited(lock, held)
            end
            blocked = {0, redis.call('PTTL', lock), ''}
            break
        end
        reserved[i] = true  -- yielded by another process to anyone but itself
    elseif current and current ~= predecessor then
        if blocking == '1' and not fair and not same_process then
            mark_waited(lock, held)
        end
        blocked = {0, redis.call('PTTL', lock), held[4] or ''}
        break
    elseif current then
        -- A takeover: within the turn, or refused, and the release yields the lock.
        local waited = tonumber(held[5])
        if waited and (tonumber(redis.call('HGET', lock, 'handoffs') or '0') >= turn[1]
                       or clock() - waited >= turn[2]) then
            redis.call('HSET', lock, 'yield', math.max(1, turn[3]))
            blocked = {0, redis.call('PTTL', lock), held[4] or ''}
            break
        end
        handed[i] = waited ~= nil
    else
        local shared = KEYS[4 * i - 1]
        local wait
        wait, no_shares[i] = shared_wait(shared, KEYS[4 * i])
        if wait then
            if blocking == '1' then
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

-- The record of waiters: a refused blocking requester keeps (or takes) its place, with
-- its process channel; one that gets in leaves it.
local queue, waiting, wake = KEYS[5], KEYS[6], KEYS[7]
local parts = {queue, waiting, wake}
local others_waited = false
if record then
    if fair or blocked then
        drop_lapsed(parts, clock())
    end
    if fair and not blocked and owned < n then
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if head and head ~= token then
            local deadline = redis.call('ZSCORE', waiting, head)
            blocked = {0, math.max(0, tonumber(deadline or clock()) - clock()), ''}
        end
    end
    local waiter_ttl = tonumber(waiter_ms) or 0
    if blocked and waiter_ttl > 0 then
        -- A place once taken keeps its arrival (NX): one call for a first try, which
        -- every blocked waiter's is (a token is new per acquisition), where asking
        -- first cost two; a refresh reads the last arrival for nothing.
        local order = tonumber(arrival)
        if not order then
            local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')[2]
            order = math.max(clock(), (tonumber(last) or 0) + 1)
        end
        redis.call('ZADD', queue, 'NX', order, token)
        redis.call('ZADD', waiting, clock() + waiter_ttl, token)
        -- The queue and the waiters' deadlines hold the same tokens (written and
        -- forgotten together), so they are created and emptied together: the queue's
        -- life stands for both.
        local keys = {queue}
        if channel ~= '' then
            -- The entry a grant is made from (wake.lua): this attempt's number, so
            -- that the waiter counts a grant only while no later attempt went out,
            -- and when it was recorded, from which the waiter counts the grant's lease.
            redis.call('HSET', wake, token, waiter_entry(channel, attempt, clock(), grant_ms,
                                                         ttl, pid, host, task_id, task_name))
            keys[#keys + 1] = wake
        end
        -- Each record key outlives its places: extended, when it would not, by twice a
        -- place's life, so that a waiter refreshing its place every try costs one
        -- PEXPIRE per key per place's life, not one per try (4 per
        -- acquisition with prefork children waiting on one key).
        for _, key in ipairs(keys) do
            if redis.call('PTTL', key) < waiter_ttl then
                redis.call('PEXPIRE', key, 2 * waiter_ttl)
                if key == queue then
                    redis.call('PEXPIRE', waiting, 2 * waiter_ttl)
                end
            end
        end
    elseif not blocked and redis.call('ZRANGE', queue, 0, 0)[1] then
        -- (Nobody recorded, this token included: one read, nothing to leave.)
        leave(parts, token)
        -- Granted (or taken over) while a waiter of another process is recorded: it
        -- waits to be named, without asking again, so this holder's turn is bounded
        -- from now (a grant carries the mark its release set).
        others_waited = not fair and owned < n and other_process_waits(queue, wake, channel)
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
        -- Granted to an earlier attempt of this token (its reply lost or late): this
        -- attempt counts it now, so that attempt's undo must leave it.
        local held = redis.call('HMGET', lock, 'fence', 'attempt')
        fence = tonumber(held[1])
        if (tonumber(held[2]) or 0) < attempt then
            redis.call('HSET', lock, 'attempt', attempt)
        end
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
        redis.call('HSET', lock, 'token', token, 'attempt', attempt, 'fence', fence_text(fence),
                   'task_id', task_id,
                   'task_name', task_name or '', 'host', host, 'pid', pid,
                   'acquired_at', acquired_at, 'ttl', ttl)
        if others_waited then
            redis.call('HSETNX', lock, 'waited', clock())
        end
        if not no_shares[i] then  -- no shared set: no writer mark of ours in it either
            redis.call('ZREM', KEYS[4 * i - 1], WRITER_MARK)
        end
    end
    redis.call('PEXPIRE', lock, ttl)
    result[i + 1] = fence
end
return result
