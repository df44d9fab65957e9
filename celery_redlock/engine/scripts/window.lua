-- window: a library put in front of the scripts that judge a rate budget's log
-- (rate, budget_read), after the prelude; not a script of its own.
--
-- span_us(window, limit)  how long, in microseconds, a start stays in the window of a
--          budget of `limit` starts per `window` ms: the window and a guard. Its body
--          starts a few ms after its admission, and one body later than the next at
--          times (a process scheduled later); the guard (10 ms at most, half a slot
--          for fast budgets) keeps the bodies' starts, not only their admissions,
--          within N per window.
-- score_us(score)  a start's score (ms, with microseconds as decimals) in microseconds.
-- latest_us(key, now_us)  the latest start the log `key` holds (reserved ones
--          included), or now, in microseconds of the node clock.
-- slot_us(key, since, used, limit, span, now_us, k)  the slot, in microseconds, of the
--          k-th start appended after the log (k = 0: the next), starts being appended
--          at or after the latest: the ((k mod N)+1)-th of the last N starts' slot (a
--          free one, of fewer than N, at the latest start), floor(k/N) spans later.
--          `used` counts the starts after `since` (a ZRANGEBYSCORE bound: the window's
--          beginning), which rate.lua has trimmed the older of and budget_read.lua not.
local function span_us(window, limit)
    return window * 1000 + math.floor(math.min(10000, window * 500 / limit))
end
local function score_us(score)
    return math.floor(tonumber(score) * 1000 + 0.5)
end
local function latest_us(key, now_us)
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    return last[2] and math.max(now_us, score_us(last[2])) or now_us
end
local function slot_us(key, since, used, limit, span, now_us, k)
    local latest = latest_us(key, now_us)
    local i = used - limit + k % limit
    local frees = latest
    if i >= 0 then
        local entry = redis.call('ZRANGEBYSCORE', key, since, '+inf', 'WITHSCORES', 'LIMIT', i, 1)
        frees = math.max(latest, score_us(entry[2]) + span)
    end
    return frees + math.floor(k / limit) * span
end
