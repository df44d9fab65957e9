-- fence: a library put in front of the scripts that grant or store fences (acquire,
-- acquire_shared, fence_sync), after the prelude; not a script of its own.
--
-- next_fence(counter, lease)  the fencing token of a new acquisition of one resource:
--          the counter + 1 while the counter key lives, else the node's clock in
--          microseconds. The counter then lives FENCE_HORIZON_LEASES leases (at least
--          FENCE_HORIZON_MIN_MS) after this acquisition, so a resource used once
--          leaves nothing behind for ever, and a fence is still larger than every
--          earlier one of its resource: while the counter lives by the counter, and
--          after it expired because the clock has moved on by at least the horizon
--          since the last fence, which was at most the clock then (a counter seeded
--          from the clock grows by one per acquisition, and an acquisition takes the
--          node more than a microsecond). Assumes the node's clock does not step back
--          by more than the horizon (docs/failure-modes.md).
-- store_fence(counter, granted)  raise the counter to the fence ``granted`` (a Redlock
--          quorum's largest, as the client sent it), keeping its expiry (giving it one
--          horizon if it had none); the fence as a number, or nil if ``granted`` is not
--          an integer (nothing stored).
-- fence_text(fence)  a fence as Redis stores it: all its digits (a Lua number would be
--          written as 1.7e+15 in a hash field or by cjson, losing them).
local function fence_text(fence)
    return string.format('%d', fence)
end
local function fence_horizon(lease)
    return math.max(FENCE_HORIZON_LEASES * lease, FENCE_HORIZON_MIN_MS)
end
local function next_fence(counter, lease)
    -- INCR first: a live counter is then one call (and its expiry one more). An INCR
    -- that answers 1 made the key (or found a counter of 0 left by an early version):
    -- start from the clock, which is larger than any fence given before.
    local fence = redis.call('INCR', counter)
    if fence == 1 then
        local t = redis.call('TIME')
        fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
        redis.call('SET', counter, fence_text(fence), 'PX', fence_horizon(lease))
    else
        redis.call('PEXPIRE', counter, fence_horizon(lease))
    end
    return fence
end
local function store_fence(counter, granted)
    local fence = tonumber(granted)
    if not fence then
        return nil
    end
    local stored = tonumber(redis.call('GET', counter) or '0')
    if stored < fence then
        redis.call('SET', counter, fence_text(fence), 'KEEPTTL')
    end
    if redis.call('PTTL', counter) < 0 then
        redis.call('PEXPIRE', counter, FENCE_HORIZON_MIN_MS)
    end
    return fence
end
