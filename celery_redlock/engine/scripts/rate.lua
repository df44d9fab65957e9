-- rate: admit one start of a key under a budget of N starts per sliding window
-- (lock_rate, RateLimit), judged on this node's clock. A log of the starts, exact.
--
-- Three scripts run this file, told apart by the prelude's PEEK and OWNED (never by an
-- argument): rate admits (or refuses) a start; rate_peek only counts, and writes
-- nothing but the trim; rate_owned admits a start logged earlier for this run (a
-- parked run's copy: its publisher logged the start before publishing it) at this
-- moment instead.
--
-- KEYS[1]  rate       the key's starts (sorted set: member -> start time in ms, node
--                     clock)
-- KEYS[2]  budget     the budget (string 'N/WINDOW_MS'); optional
-- KEYS[3]  queued     the runs waiting on the queue for the key (sorted set: task id
--                     -> due time in ms, node clock; the library queued.lua); optional
-- ARGV[1]  limit      N, the starts allowed per window (integer, 1 to 1000000)
-- ARGV[2]  window_ms  the window in milliseconds (positive integer, at most 30 days)
-- ARGV[3]  member     this start's member (unique per admission: a token)
-- ARGV[4]  task_id    the task id of the run asking ('' or absent: none, e.g. a
--                     RateLimit)
-- ARGV[5]  jitter_ms  with a task id: ms after its slot when the refused run is due
--                     again (a small random margin it is put back with)
-- ARGV[6]  grace_ms   with a task id: the grace in ms (keys.QUEUED_GRACE) of the
--                     queued runs' entries
--
-- Returns  {1, used, 0}        admitted: the start is logged; used counts it
--          {0, used, wait_ms}  N starts in the last window: the oldest leaves it
--                              in wait_ms (at least 1)
--          {2, used, wait_ms}  peek: used now, and wait_ms until a start would be
--                              admitted (0: now)
-- A member logged already (the same admission sent again) is admitted again without a
-- second entry (except by rate_owned: then it is judged again, at now). The key expires one window after its last start: nothing of it
-- outlives its last use by more than one window.
--
-- Starts are logged in ms with the node clock's microseconds as decimals, and a start
-- leaves the window when it is window ms old or older: two starts of a "1/s" budget are
-- never less than 1 s apart on the node's clock (whole ms lost up to 1 ms: measured
-- 999.4 ms).
--
-- A refused run with a task id gets a place in line, not only the next slot: the
-- runs already waiting for the key (queued, due earlier than this run's own earlier
-- entry, if any) are served first, slot after slot, so the k-th waiting run is due
-- when the ((k mod N)+1)-th of the last N starts leaves the window, floor(k/N) windows
-- later. Without it, every refused run came back at the next slot and all but N were
-- refused again: a backlog of B runs cost about B^2/(2N) deliveries instead of B.
-- A run that comes back early (its countdown was capped) keeps its place.
--
-- The budget is written with each admission, in this call (no round trip of its own),
-- so that `celery redlock ls` can show used/limit: a node keeps only the log, which
-- does not say N or the window. It is a string key beside the log, expiring with it
-- (the same PX, set at the same moment), rather than a reserved member of the log: a
-- member would count in ZCARD and take a rank, so every reader of the log (this
-- script, rate_return, an older version's rate.lua during an upgrade) would have to
-- skip it, and one that did not would admit N - 1 or miscount the oldest start. Beside
-- it, the log stays exactly the starts. A refused run with a task id is recorded in
-- queued as due at the end of its wait (plus jitter_ms); an admitted one leaves it.
local limit, window, member = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local task_id, jitter_ms, grace_text = ARGV[4], ARGV[5], ARGV[6]
if not limit or limit < 1 or limit > 1000000 or limit ~= math.floor(limit) then
    return redis.error_reply('ERR celery_redlock rate: N must be an integer from 1 to 1000000')
end
if not window or window <= 0 or window > 2592000000 or window ~= math.floor(window) then
    return redis.error_reply('ERR celery_redlock rate: window must be a positive integer of ms, at most 30 days')
end
if member == nil or member == '' then
    return redis.error_reply('ERR celery_redlock rate: empty member')
end
if not KEYS[3] or task_id == '' then
    task_id = nil
end
local jitter, grace = 0, nil
if task_id then
    jitter, grace = tonumber(jitter_ms), grace_ms(grace_text)
    if not jitter or jitter < 0 or jitter ~= math.floor(jitter) or not grace then
        return redis.error_reply('ERR celery_redlock rate: a task id needs a whole jitter >= 0 and a grace > 0 in ms')
    end
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
local function ms_text(us)
    return string.format('%.3f', us / 1000)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms_text(now_us - window * 1000))
local used = redis.call('ZCARD', KEYS[1])
local function wait_ms(ahead)
    -- Served after `ahead` waiting runs: the slot of the ((ahead mod N)+1)-th of the
    -- last N starts, floor(ahead/N) windows later (ahead 0: the next slot).
    local rank = used - limit + ahead % limit
    local oldest = redis.call('ZRANGE', KEYS[1], rank, rank, 'WITHSCORES')
    local leaves_us = math.floor(tonumber(oldest[2]) * 1000 + 0.5) + window * 1000
    local windows = math.floor(ahead / limit)
    -- Each window ahead, the runs before this one start a little after their slots (a
    -- delivery's lag), and their own slots free that much later: allow for it, or this
    -- run comes back a hair early and is put back once more (measured: 34 deferrals
    -- for 20 early runs of 25 at 5/s without).
    local lag = windows * math.min(30, window / limit / 5)
    local wait = math.ceil((leaves_us - now_us) / 1000 + lag) + windows * window
    return math.max(1, wait)
end
local function waiting_ahead()
    -- The runs that wait for the key and are served before this one.
    if not task_id then
        return 0
    end
    -- Entries due more than the grace ago are not counted (queue_run trims them next).
    local since = now - grace
    local mine = redis.call('ZSCORE', KEYS[3], task_id)
    if mine then
        return redis.call('ZCOUNT', KEYS[3], since, '(' .. mine)
    end
    return redis.call('ZCOUNT', KEYS[3], since, '+inf')
end
local function starts()
    -- The run starts: it no longer waits on the queue.
    if task_id then
        redis.call('ZREM', KEYS[3], task_id)
    end
end
if PEEK then
    if used < limit then
        return {2, used, 0}
    end
    return {2, used, wait_ms(0)}
end
if redis.call('ZSCORE', KEYS[1], member) then
    if not OWNED then
        starts()
        return {1, used, 0}
    end
    -- The start logged for this run kept its slot while the run went through the
    -- broker; it moves to now, the body's start, if the window still has room for it
    -- without it (the copy may come late: the starts logged since must not be crowded
    -- into one window with it). Else it is given back and the run is refused as any.
    redis.call('ZREM', KEYS[1], member)
    used = used - 1
end
if used >= limit then
    local wait = wait_ms(waiting_ahead())
    if task_id then
        queue_run(KEYS[3], task_id, now + wait + jitter, now, grace)
    end
    return {0, used, wait}
end
redis.call('ZADD', KEYS[1], ms_text(now_us), member)
redis.call('PEXPIRE', KEYS[1], window)
if KEYS[2] then
    redis.call('SET', KEYS[2], string.format('%d/%d', limit, window), 'PX', window)
end
starts()
return {1, used + 1, 0}
