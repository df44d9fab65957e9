-- wake: a library put in front of the scripts that keep or read the record of an
-- exclusive lock's blocked waiters (acquire, release, release_if, fair_leave), after the
-- prelude; not a script of its own.
--
-- The record (one resource): queue (sorted set token -> arrival), waiting (sorted set
-- token -> deadline, node ms: the place lapses unless refreshed) and wake (hash token
-- -> the waiter's process channel, where a release names it).
--
-- ms_arg(value)  a reservation argument: a non-negative integer of ms (at most 30
--          days), or nil (the caller answers with its own error).
-- naming_args(how, reserve)  how a script names waiters ('fair' or 'wake') and, with
--          'wake', the reservation: the reservation in ms (0 for 'fair'), or nil and
--          what is wrong.
-- node_ms()  the node's clock, in ms.
-- forget(record, tokens)  take tokens out of every part of the record.
-- leave(record, token)  take a token out of the record if it is in it (one call if not).
-- drop_lapsed(record, now)  forget the waiters whose place lapsed.
-- first_waiter(queue, wake, skip)  the oldest recorded token whose process channel is
--          not `skip` (false: any), and its channel (false if it recorded none).
-- other_process_waits(queue, wake, channel)  a waiter of another process than
--          `channel`'s is recorded.
-- name_next(lock, channel, record, how, reserve, skip, fence)  announce that `lock`
--          (deleted by the caller) is free to the oldest recorded waiter, on its
--          process channel (one delivery, one process), with its token as the message
--          (one waiter woken); on the lock's channel if it recorded no process
--          channel. `record` = {queue, waiting, wake}. Nobody recorded costs one
--          read; the record is cleared of lapsed waiters when the one found first has
--          lapsed (a refused requester clears it too, acquire.lua).
--          how 'fair': the waiter keeps its place (only the head of the queue may
--          take a free lock anyway). how 'wake': the waiter leaves the record (it
--          comes back, or it is gone: either way it is named once) and, if `reserve`
--          > 0, the lock is reserved for it for `reserve` ms: a YIELD_MARK hash whose
--          field 'for' names it, refused to any other token, so a requester that did
--          not wait (the releaser coming straight back) cannot take the lock between
--          the release and the named waiter's try.
--          The reservation is the take-up bound of a named waiter: one that does not
--          come (its process stopped, or died) keeps the lock idle `reserve` ms, no
--          longer. So that the lock then passes on, the oldest recorded waiter of
--          another process than the named one's is told "TOKEN RESERVE" on its own
--          process channel: its listener wakes it `reserve` ms later unless a release
--          names it first (waiting.py, the stand-by).
--          Field 'waited' is set on the reservation when a waiter of another process
--          is still recorded: the named waiter's process then has a bounded turn
--          (handoff.TURN). Returns the named token, or nil when nobody is recorded
--          (the caller publishes then).
local function ms_arg(value)
    local ms = tonumber(value)
    if not ms or ms < 0 or ms > 2592000000 or ms ~= math.floor(ms) then
        return nil
    end
    return ms
end
local function naming_args(how, reserve)
    if how == 'fair' then
        return 0
    elseif how ~= 'wake' then
        return nil, "how must be 'fair' or 'wake'"
    end
    local ms = ms_arg(reserve)
    if not ms then
        return nil, 'a reservation must be a non-negative integer of ms'
    end
    return ms
end
local function node_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function forget(record, tokens)
    redis.call('ZREM', record[1], unpack(tokens))
    redis.call('ZREM', record[2], unpack(tokens))
    redis.call('HDEL', record[3], unpack(tokens))
end
local function leave(record, token)
    if redis.call('ZREM', record[2], token) == 1 then
        forget(record, {token})
    end
end
local function drop_lapsed(record, now)
    local gone = redis.call('ZRANGEBYSCORE', record[2], '-inf', now)
    if #gone > 0 then
        forget(record, gone)
    end
end
local WAKE_PAGE = 16
local function first_waiter(queue, wake, skip)
    local start = 0
    while true do
        local page = redis.call('ZRANGE', queue, start, start + WAKE_PAGE - 1)
        if #page == 0 then
            return nil, false
        end
        local targets = redis.call('HMGET', wake, unpack(page))
        for j, token in ipairs(page) do
            if not skip or targets[j] ~= skip then
                return token, targets[j]
            end
        end
        if #page < WAKE_PAGE then
            return nil, false
        end
        start = start + WAKE_PAGE
    end
end
local function other_process_waits(queue, wake, channel)
    return first_waiter(queue, wake, channel) ~= nil
end
local function name_next(lock, channel, record, how, reserve, skip, fence)
    local queue, waiting, wake = record[1], record[2], record[3]
    local named, target = first_waiter(queue, wake, skip)
    if not named then
        return nil
    end
    local now = node_ms()
    if (tonumber(redis.call('ZSCORE', waiting, named)) or now) <= now then
        drop_lapsed(record, now)
        named, target = first_waiter(queue, wake, skip)
        if not named then
            return nil
        end
    end
    local standby, standby_target
    if how == 'wake' then
        forget(record, {named})
        if reserve > 0 then
            redis.call('HSET', lock, 'token', YIELD_MARK, 'for', named, 'fence', fence,
                       'ttl', reserve)
            if target then
                redis.call('HSET', lock, 'wake', target)
            end
            standby, standby_target = first_waiter(queue, wake, target or '')
            if standby then  -- a waiter of another process: the named one's turn is bounded
                redis.call('HSET', lock, 'waited', now)
            end
            redis.call('PEXPIRE', lock, reserve)
        end
    end
    redis.call('PUBLISH', target or channel, named)
    if standby_target then
        redis.call('PUBLISH', standby_target, standby .. ' ' .. reserve)
    end
    return named
end
