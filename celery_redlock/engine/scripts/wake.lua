-- wake: a library put in front of the scripts that keep or read the record of an
-- exclusive lock's blocked waiters (acquire, release, release_if, fair_leave), after the
-- prelude; not a script of its own.
--
-- The record (one resource): queue (sorted set token -> arrival), waiting (sorted set
-- token -> deadline, node ms: the place lapses unless refreshed) and wake (hash token
-- -> the waiter's entry: its process channel, where a release names it, then, each
-- after a NUL, what a grant to it writes: the number of the attempt that recorded it,
-- when the node recorded it (node ms), the grant's lease (ms), its own lease (ms), pid,
-- host, task id and task name; see waiter_entry).
--
-- ms_arg(value)  a reservation argument: a non-negative integer of ms (at most 30
--          days), or nil (the caller answers with its own error).
-- naming_args(how, reserve)  how a script names waiters ('fair' or 'wake') and
--          whether a release grants the lock (a positive `reserve`, in ms), or nil and
--          what is wrong.
-- node_ms()  the node's clock, in ms.
-- waiter_entry(channel, attempt, recorded, grant_ms, ttl, pid, host, task_id, task_name)
--          a waiter's entry in the record (`recorded`: the node's clock, ms).
-- forget(record, tokens)  take tokens out of every part of the record.
-- leave(record, token)  take a token out of the record if it is in it (one call if not).
-- drop_lapsed(record, now)  forget the waiters whose place lapsed.
-- first_waiter(queue, wake, skip, newest)  the oldest (`newest`: the newest) recorded
--          token whose process channel is not `skip` (false: any), its channel (false
--          if it recorded none) and its entry.
-- other_process_waits(queue, wake, channel)  a waiter of another process than
--          `channel`'s is recorded.
-- name_next(lock, counter, channel, record, how, reserve, skip)  hand `lock` (deleted
--          by the caller) to the oldest recorded waiter whose process channel is not
--          `skip` (false: any), announced on its process channel (one
--          delivery, one process); on the lock's channel if it recorded no process
--          channel. `record` = {queue, waiting, wake}; `counter` the lock's fence
--          counter. Nobody recorded costs one read; the record is cleared of lapsed
--          waiters when the one found first has lapsed (a refused requester clears it
--          too, acquire.lua).
--          If `reserve` > 0 (and the waiter recorded a channel), the waiter leaves the
--          record (it comes back, or it is gone: either way it is named once) and the
--          lock is GRANTED to it here, fair or not (a fair lock's oldest waiter is the
--          head of its queue): written in its token's name with a new fence and the
--          waiter's fields, for the grant's lease that the waiter asked for (its
--          entry), and the announcement is "TOKEN ATTEMPT FENCE ELAPSED": the waiter
--          holds the lock without asking again, provided that attempt is still its
--          last one, its lease counted from when it sent that attempt plus ELAPSED, the
--          ms the node counted from recording that attempt to this grant (the node
--          recorded it after it was sent, so the waiter's count ends first). The lock
--          hash's 'attempt' is ATTEMPT + 0.5: the undo of that attempt (a split vote's)
--          leaves the grant, the undo of a later attempt that counted it removes it.
--          Else the waiter is only named ("TOKEN": it tries); 'wake' forgets it, 'fair'
--          keeps its place (only the head may take a free lock).
--          The grant's lease is the take-up bound of a named waiter: one that does
--          not come (its process stopped, or died) keeps the lock idle that long, no
--          longer. So that the lock then passes on, a recorded waiter of another
--          process than the named one's, its stand-by, is told "TOKEN MS" on its own
--          process channel: its listener wakes it MS later unless a release names it
--          first (waiting.py, the stand-by). It tries then, and takes the lock if the
--          named waiter never came (or, refused, waits no longer than what is left of
--          the grant's lease, and tries again). A fair lock's stand-by is the oldest
--          such waiter, told at every grant: only the head may take a free fair lock.
--          Any waiter may take a free 'wake' lock, so its stand-by is the newest such
--          waiter, and stays it while it is still recorded and was told less than half
--          a grant's lease ago: the oldest would be granted the lock next, and need a
--          successor at every grant, one more delivery (a thread woken in another
--          process) per handoff. Told then, its wake-up comes at most MS after this
--          grant, no earlier than half of it (the wake hash's STANDBY field: token,
--          channel, when told).
--          Field 'waited' is set on the grant when a waiter of another process is
--          still recorded: the named waiter's process then has a bounded turn
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
    if how ~= 'fair' and how ~= 'wake' then
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
local SEP = '\0'
-- The wake hash's field naming the stand-by last told (no token starts with a NUL).
local STANDBY = SEP .. 'standby'
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
local function waiter_entry(channel, attempt, recorded, grant_ms, ttl, pid, host, task_id,
                            task_name)
    return table.concat({channel, attempt, recorded, grant_ms, ttl, pid, host, task_id,
                         task_name}, SEP)
end
local function entry_channel(entry)
    if not entry then
        return false
    end
    local cut = string.find(entry, SEP, 1, true)
    return cut and string.sub(entry, 1, cut - 1) or entry
end
-- The grant fields of an entry: {attempt, recorded, grant_ms, ttl, pid, host, task_id,
-- task_name}, or nil if it has none (a waiter recorded without a channel).
local function entry_grant(entry)
    local start = entry and string.find(entry, SEP, 1, true)
    if not start then
        return nil
    end
    local fields = {}
    for j = 1, 8 do
        local cut = string.find(entry, SEP, start + 1, true)
        fields[j] = string.sub(entry, start + 1, (cut or 0) - 1)
        if not cut then
            return j == 8 and fields or nil
        end
        start = cut
    end
    return nil
end
local WAKE_PAGE = 16
local function first_waiter(queue, wake, skip, newest)
    local start = 0
    while true do
        local page = newest and redis.call('ZRANGE', queue, start, start + WAKE_PAGE - 1, 'REV')
                     or redis.call('ZRANGE', queue, start, start + WAKE_PAGE - 1)
        if #page == 0 then
            return nil, false
        end
        local entries = redis.call('HMGET', wake, unpack(page))
        for j, token in ipairs(page) do
            local target = entry_channel(entries[j])
            if not skip or target ~= skip then
                return token, target, entries[j]
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
local function stand_by(record, how, skip, now, lease)
    local queue, waiting, wake = record[1], record[2], record[3]
    local told = how == 'wake' and redis.call('HGET', wake, STANDBY)
    local token, channel, at = string.match(told or '', '^(.-)%z(.*)%z(%d+)$')
    if token and channel ~= skip and now - tonumber(at) < lease / 2 then
        local deadline = tonumber(redis.call('ZSCORE', waiting, token))
        if deadline and deadline > now then
            return token, nil
        end
    end
    token, channel = first_waiter(queue, wake, skip, how == 'wake')
    if token and channel and how == 'wake' then
        local entry = table.concat({token, channel, string.format('%d', now)}, SEP)
        redis.call('HSET', wake, STANDBY, entry)
    elseif told then
        -- Nobody of another process waits: the field goes, and with the last waiter
        -- the record (one that leaves or lapses instead leaves it to the key's expiry).
        redis.call('HDEL', wake, STANDBY)
    end
    return token, channel
end
local function name_next(lock, counter, channel, record, how, reserve, skip)
    local queue, waiting, wake = record[1], record[2], record[3]
    local named, target, entry = first_waiter(queue, wake, skip)
    if not named then
        return nil
    end
    local now = node_ms()
    if (tonumber(redis.call('ZSCORE', waiting, named)) or now) <= now then
        drop_lapsed(record, now)
        named, target, entry = first_waiter(queue, wake, skip)
        if not named then
            return nil
        end
    end
    local message, standby, standby_target, idle = named, nil, nil, 0
    local grant = reserve > 0 and entry_grant(entry)
    local recorded = grant and tonumber(grant[2])
    local grant_ms = grant and ms_arg(grant[3])
    local ttl = grant and ms_arg(grant[4])
    if recorded and grant_ms and grant_ms > 0 and ttl and ttl > 0 then
        forget(record, {named})
        local fence = fence_text(next_fence(counter, ttl))
        local fields = {'token', named, 'attempt', grant[1] .. '.5', 'fence', fence,
                        'task_id', grant[7], 'task_name', grant[8], 'host', grant[6],
                        'pid', grant[5], 'acquired_at', string.format('%.3f', now / 1000),
                        'ttl', ttl}
        standby, standby_target = stand_by(record, how, target or '', now, grant_ms)
        if standby then  -- a waiter of another process: the named one's turn is bounded
            fields[#fields + 1], fields[#fields + 2] = 'waited', now
        end
        redis.call('HSET', lock, unpack(fields))
        redis.call('PEXPIRE', lock, grant_ms)
        local elapsed = math.max(0, now - recorded)
        message = table.concat({named, grant[1], fence, string.format('%d', elapsed)}, ' ')
        idle = grant_ms
    elseif how == 'wake' then
        forget(record, {named})
    end
    redis.call('PUBLISH', target or channel, message)
    if standby_target then
        redis.call('PUBLISH', standby_target, standby .. ' ' .. idle)
    end
    return named
end
