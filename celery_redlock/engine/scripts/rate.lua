-- rate: admit one start of a key under a budget of N starts per sliding window
-- (lock_rate, RateLimit), judged on this node's clock. A log of the starts, exact.
--
-- Three scripts run this file, told apart by the prelude's PEEK and OWNED (never by an
-- argument): rate admits (or refuses) a start; rate_peek only counts, and writes
-- nothing but the trim; rate_owned admits a start reserved earlier for this run (a
-- parked run's copy: its publisher reserved the start before publishing it) at this
-- moment instead (below).
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
-- ARGV[7]  at_ms      the earliest the start may be, in ms from now ('' or 0: now)
-- ARGV[8]  ahead_ms   the latest it may be, in ms from now, at least at_ms and at most
--                     two windows ('' or 0: at_ms): a start reserved ahead (a parked
--                     run's copy is published with a countdown to it)
--
-- Returns  {1, used, in_ms}    admitted: the start is logged, in_ms from now (0 but
--                              for a start reserved ahead); used counts it
--          {0, used, wait_ms}  N starts in the last window: the oldest leaves it
--                              in wait_ms (at least 1)
--          {2, used, wait_ms}  peek: used now, and wait_ms until a start would be
--                              admitted (0: now)
-- A member logged already (the same admission sent again) is admitted again without a
-- second entry (rate_owned: see below). The key expires one window (and the guard,
-- below) after its last start: nothing of it outlives its last use by more.
--
-- Starts are appended: a start is logged at or after the latest one logged, when the
-- N-th latest is at least one window older than it. So the log holds at most N starts
-- in any window (every N+1 consecutive starts span a window) with starts reserved
-- ahead in it as well as past ones, and the next start's slot is always
-- max(latest, N-th latest + window): a newcomer never takes a slot reserved for a run
-- ahead of it (it is refused, and placed after the reserved ones).
--
-- rate_owned: the copy of a parked run whose start was reserved for it (its member).
-- Come early (its countdown ran on another clock), it is told to wait until then and
-- keeps the reservation; on time or late, its start moves to now (the body's moment)
-- when the windows after the reservation have room for it there (fewer than N starts
-- between the reservation and one window after now: every window holding now then has
-- at most N); else the reservation is given up and the run judged as any newcomer.
--
-- Starts are logged in ms with the node clock's microseconds as decimals, and a start
-- leaves the window when it is window ms and a guard old or older: two starts of a
-- "1/s" budget are never less than 1 s apart on the node's clock, nor their bodies'
-- starts unless one was delayed 10 ms more than the other.
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
local at, ahead = tonumber(ARGV[7] or '') or 0, tonumber(ARGV[8] or '') or 0
if at < 0 or ahead < 0 or at > window or ahead > 2 * window then
    return redis.error_reply('ERR celery_redlock rate: at_ms must be from 0 to the window, ahead_ms to two windows')
end
ahead = math.max(at, ahead)
if not KEYS[3] or task_id == '' then
    task_id = nil
end
local jitter, grace = 0, nil
if task_id then
    jitter, grace = tonumber(jitter_ms), grace_ms(grace_text)
    if not jitter or jitter < 0 or jitter > 1000000000000 or jitter ~= math.floor(jitter) or not grace then
        return redis.error_reply('ERR celery_redlock rate: a task id needs a whole jitter >= 0 and a grace > 0 in ms')
    end
end
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
-- A start leaves the window a guard after it is a window old (the library window.lua).
local window_us = span_us(window, limit)
local function ms_text(us)
    return string.format('%.3f', us / 1000)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms_text(now_us - window_us))
local used = redis.call('ZCARD', KEYS[1])
-- The window's beginning: every start the trim left is after it.
local since = '(' .. ms_text(now_us - window_us)
local function slot(k)
    -- The slot of the k-th start after the log's end (window.lua).
    return slot_us(KEYS[1], since, used, limit, window_us, now_us, k)
end
local function wait_ms(k)
    -- Served after k waiting runs. Each window ahead, the runs before this one start a
    -- little after their slots (a delivery's lag), and their own slots free that much
    -- later: allow for it, or this run comes back a hair early and is put back once
    -- more (measured: 34 deferrals for 20 early runs of 25 at 5/s without).
    local windows = math.floor(k / limit)
    local lag = windows * math.min(30, window / limit / 5)
    return math.max(1, math.ceil((slot(k) - now_us) / 1000 + lag))
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
local function log(start_us)
    -- Log the start; keep the log (and the budget beside it) one window past its
    -- latest start, never shortening it.
    redis.call('ZADD', KEYS[1], ms_text(start_us), member)
    local keep = math.ceil((latest_us(KEYS[1], now_us) - now_us + window_us) / 1000)
    if redis.call('PTTL', KEYS[1]) < keep then
        redis.call('PEXPIRE', KEYS[1], keep)
    end
    if KEYS[2] then
        redis.call('SET', KEYS[2], string.format('%d/%d', limit, window), 'PX', keep)
    end
    -- The run starts: it no longer waits on the queue.
    if task_id then
        redis.call('ZREM', KEYS[3], task_id)
    end
end
if PEEK then
    if slot(0) <= now_us then
        return {2, used, 0}
    end
    return {2, used, wait_ms(0)}
end
local logged = redis.call('ZSCORE', KEYS[1], member)
if logged and not OWNED then
    log(score_us(logged))
    return {1, used, math.max(0, math.ceil((score_us(logged) - now_us) / 1000))}
end
if logged then
    local reserved = score_us(logged)
    if reserved > now_us then
        return {0, used, math.max(1, math.ceil((reserved - now_us) / 1000))}
    end
    local after = redis.call('ZCOUNT', KEYS[1], '(' .. logged, '(' .. ms_text(now_us + window_us))
    if after < limit then
        log(now_us)
        return {1, used, 0}
    end
    redis.call('ZREM', KEYS[1], member)
    used = used - 1
end
local next_slot = slot(0)
if next_slot > now_us + ahead * 1000 then
    local wait = wait_ms(waiting_ahead())
    if task_id then
        queue_run(KEYS[3], task_id, now + wait + jitter, now, grace)
    end
    return {0, used, wait}
end
local start = math.max(next_slot, now_us + at * 1000)
log(start)
return {1, used + 1, math.ceil((start - now_us) / 1000)}
