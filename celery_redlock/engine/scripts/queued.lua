-- queued: a library put in front of the scripts that record the runs waiting on the
-- queue for a key (rate, note_queued), after the prelude; not a script of its own.
--
-- queue_run(key, task_id, due, now, grace)  record that the run ``task_id`` waits on
--          the queue until ``due`` (ms, node clock), replacing its earlier entry (a
--          run deferred again is still one run); drop the entries due more than
--          ``grace`` ms ago (runs that never came back: purged, revoked, lost), and
--          keep the key until its latest due + grace, so nothing of it outlives the
--          last run it counts by more than the grace.
-- grace_ms(text)  ARGV text as a grace in ms (a positive integer), or nil.
local function grace_ms(text)
    local grace = tonumber(text)
    if not grace or grace <= 0 or grace > 1000000000000 or grace ~= math.floor(grace) then
        return nil
    end
    return grace
end
local function queue_run(key, task_id, due, now, grace)
    redis.call('ZADD', key, due, task_id)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('(%d', now - grace))
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) + grace - now))
end
