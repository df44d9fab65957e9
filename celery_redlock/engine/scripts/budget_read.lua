-- budget_read: what a key's rate budget and its queue look like now, for
-- `celery redlock ls`, `inspect` and `doctor`. Reads only: writes nothing, not even
-- the trim rate.lua does (entries past the window or the grace are not counted).
--
-- KEYS[1]  rate      the key's starts (sorted set, see rate.lua)
-- KEYS[2]  budget    the budget (string 'N/WINDOW_MS', written by rate.lua)
-- KEYS[3]  queued    the runs waiting on the queue for the key (sorted set, see
--                    queued.lua)
-- ARGV[1]  grace_ms  the grace in ms (keys.QUEUED_GRACE) after which a run due is not
--                    counted
-- ARGV[2]  most      the most waiting runs to list (0 or absent: none)
--
-- Returns  {budget, used, wait_ms, queued, waiting}
--          budget  'N/WINDOW_MS', or '' when none is recorded (no start for one
--                  window, or logged by a version that did not record it)
--          used    starts in the current window (without a budget: in the log)
--          wait_ms until a start would be admitted (0: now; -1 without a budget),
--                  after the starts reserved ahead
--          queued  runs waiting on the queue, due at most the grace ago
--          waiting the first `most` of them, soonest due first: {task_id, due_in_ms,
--                  ...} (due_in_ms negative for a run due and not yet started)
local grace_ms = ARGV[1]
local grace = tonumber(grace_ms)
if not grace or grace <= 0 then
    return redis.error_reply('ERR celery_redlock budget_read: grace must be positive ms')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local queued = redis.call('ZCOUNT', KEYS[3], now - grace, '+inf')
local most = tonumber(ARGV[2] or '') or 0
local waiting = {}
if most > 0 then
    local found = redis.call('ZRANGEBYSCORE', KEYS[3], now - grace, '+inf', 'WITHSCORES', 'LIMIT', 0, most)
    for i = 1, #found, 2 do
        waiting[#waiting + 1] = found[i]
        waiting[#waiting + 1] = math.floor(tonumber(found[i + 1]) - now)
    end
end
local budget = redis.call('GET', KEYS[2])
if not budget then
    return {'', redis.call('ZCARD', KEYS[1]), -1, queued, waiting}
end
local limit, window = string.match(budget, '^(%d+)/(%d+)$')
limit, window = tonumber(limit), tonumber(window)
if not limit then
    return {'', redis.call('ZCARD', KEYS[1]), -1, queued, waiting}
end
-- As rate.lua judges it: a start stays a window and its guard (window.lua), starts
-- reserved ahead count, and the next slot is max(latest, N-th latest + that span).
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local span = span_us(window, limit)
local since = string.format('(%.3f', (now_us - span) / 1000)
local used = redis.call('ZCOUNT', KEYS[1], since, '+inf')
local slot = slot_us(KEYS[1], since, used, limit, span, now_us, 0)
local wait = slot > now_us and math.max(1, math.ceil((slot - now_us) / 1000)) or 0
return {budget, used, wait, queued, waiting}
