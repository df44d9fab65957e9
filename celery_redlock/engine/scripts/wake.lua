-- wake: a library put in front of the scripts that keep or read the record of an
-- exclusive lock's blocked waiters (acquire, release, release_if, fair_leave), after the
-- prelude; not a script of its own.
--
-- The record (one resource): queue (sorted set token -> arrival), waiting (sorted set
-- token -> deadline, node ms: the place lapses unless refreshed), wake (hash token ->
-- the waiter's process channel, where a release names it) and grant (hash token -> the
-- holder fields a release writes when it grants the lock to that waiter in place, a
-- JSON array [ttl ms, task_id, host, pid, task_name]; only waiters that can take a
-- lock granted this way record it: one node, see Redlock.acquire).
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
--          not `skip` (false: any), its channel (false if it recorded none), and what
--          was read to find it ({page of tokens, their channels, whether the page was
--          the whole queue}), for other_process_waits.
-- other_process_waits(queue, wake, channel, seen, named)  a waiter of another process
--          than `channel`'s is recorded. With `seen` (first_waiter's third value,
--          `named` its token, which has left the record since) answered from that page
--          when it can be, else read.
-- name_next(lock, channel, record, how, reserve, skip, fence, grants)  announce
--          that `lock` (deleted by the caller) is free to the oldest recorded waiter,
--          on its process channel (one delivery, one process), with its token as the
--          message (one waiter woken); on the lock's channel if it recorded no process
--          channel. `record` = {queue, waiting, wake, grant}. Nobody recorded costs
--          one read; the record is cleared of lapsed waiters when the one found first
--          has lapsed (a refused requester clears it too, acquire.lua).
--          With `grants` = {fence counter, abandoned tokens} and a waiter that
--          recorded its holder fields, the lock is *granted*: written for that waiter
--          in place (a new fence, a lease of the ttl it asked for) and the message is
--          its token and the fence, so the waiter wakes holding it, with no try of its
--          own (issue 27, change C). With grants[3], the caller's own process channel:
--          a waiter on that channel is granted without a message (the caller wakes it
--          in its own process), and its fence is returned second. Nobody subscribed to
--          its process channel (the process died, or its listener is reconnecting,
--          when every waiter there retries anyway): the grant is taken back and the
--          next waiter named. An abandoned token is passed over. Either way the
--          waiter leaves the record.
--          Otherwise: how 'fair': the waiter keeps its place (only the head of the
--          queue may take a free lock anyway). how 'wake': the waiter leaves the
--          record (it comes back, or it is gone: either way it is named once) and, if
--          `reserve` > 0, the lock is reserved for it for `reserve` ms: a YIELD_MARK
--          hash whose field 'for' names it, refused to any other token, so a requester
--          that did not wait (the releaser coming straight back) cannot take the lock
--          between the release and the named waiter's try.
--          Field 'waited' is set (on the grant or the reservation) when a waiter of
--          another process is still recorded: the named waiter's process then has a
--          bounded turn (handoff.TURN). Returns the named token, or nil when nobody is
--          recorded (the caller publishes then).
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
        return nil, "ARGV[2] must be 'fair' or 'wake'"
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
    redis.call('HDEL', record[4], unpack(tokens))
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
                return token, targets[j], {page, targets, start == 0 and #page < WAKE_PAGE}
            end
        end
        if #page < WAKE_PAGE then
            return nil, false
        end
        start = start + WAKE_PAGE
    end
end
local function other_process_waits(queue, wake, channel, seen, named)
    if seen then
        -- What first_waiter read (the page that named `named`): nothing has left the
        -- queue since but `named`, so when that page was the whole queue it answers
        -- without another read (issue 27: two calls per granting release).
        local page, targets, whole = seen[1], seen[2], seen[3]
        for j, token in ipairs(page) do
            if token ~= named and targets[j] ~= channel then
                return true
            end
        end
        if whole then
            return false
        end
    end
    return first_waiter(queue, wake, channel) ~= nil
end
-- Grants taken back from waiters nobody listens for, at most, in one release: past
-- them the release names the next waiter without a grant (one SUBSCRIBE-less process
-- after another is a node whose clients are going away).
local GRANT_TRIES = 4
local function grant_to(lock, named, target, details, grants, now)
    local ttl, task_id, host, pid, task_name = unpack(cjson.decode(details))
    local fence = next_fence(grants[1], ttl)
    redis.call('HSET', lock, 'token', named, 'fence', fence_text(fence), 'task_id', task_id,
               'task_name', task_name, 'host', host, 'pid', pid,
               'acquired_at', string.format('%.3f', now / 1000), 'ttl', ttl)
    redis.call('PEXPIRE', lock, ttl)
    if target == grants[3] then
        return true, fence  -- a waiter of the caller's own process: the caller tells it
    end
    return redis.call('PUBLISH', target, named .. ' ' .. fence_text(fence)) > 0
end
local function name_next(lock, channel, record, how, reserve, skip, fence, grants)
    local queue, waiting, wake = record[1], record[2], record[3]
    local named, target, seen = first_waiter(queue, wake, skip)
    if not named then
        return nil
    end
    local now = node_ms()
    if (tonumber(redis.call('ZSCORE', waiting, named)) or now) <= now then
        drop_lapsed(record, now)
        named, target, seen = first_waiter(queue, wake, skip)
    end
    local tries = 0
    while named and grants and target and tries < GRANT_TRIES do
        local details = redis.call('HGET', record[4], named)
        if not details then
            break
        end
        tries = tries + 1
        forget(record, {named})
        if not redis.call('ZSCORE', grants[2], named) then
            local heard, here = grant_to(lock, named, target, details, grants, now)
            if heard then
                if other_process_waits(queue, wake, target, seen, named) then
                    redis.call('HSET', lock, 'waited', now)
                end
                return named, here
            end
            redis.call('DEL', lock)  -- nobody heard it: taken back
        end
        named, target, seen = first_waiter(queue, wake, skip)
    end
    if not named then
        return nil
    end
    if how == 'wake' then
        forget(record, {named})
        if reserve > 0 then
            redis.call('HSET', lock, 'token', YIELD_MARK, 'for', named, 'fence', fence,
                       'ttl', reserve)
            if target then
                redis.call('HSET', lock, 'wake', target)
            end
            if other_process_waits(queue, wake, target or '', seen, named) then
                redis.call('HSET', lock, 'waited', now)
            end
            redis.call('PEXPIRE', lock, reserve)
        end
    end
    redis.call('PUBLISH', target or channel, named)
    return named
end
