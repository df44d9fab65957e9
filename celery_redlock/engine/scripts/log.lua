-- log: append events to capped lists, stamped with this node's clock.
--
-- The event log (celery_redlock.integration.events) keeps what happened to locked runs
-- in lists on a lock node: one per lock (its history, `celery redlock log KEY`) and one
-- per prefix (the feed that `celery redlock why TASK_ID` searches). A process batches
-- its events and writes them with one call; each event is given the node's time when
-- it happened (the call's time less how long the event waited in the batch), so events
-- written by different machines sort by one clock. Each list keeps its newest `cap`
-- entries and expires `lifetime_ms` after its last one: memory is bounded by the keys
-- used within that horizon, whatever the number of keys ever used.
--
-- KEYS[1..n]   logs*     each list to append to (a lock's log, or the feed)
-- ARGV[1..4n]  entries*  four per key i, in the order of the keys: how long ago the
--                        event happened (ms, non-negative integer), the event as a JSON
--                        object (its "t" is added here), the list's cap (entries kept,
--                        1 to 100000) and its lifetime (ms, 1 to 1e12)
--
-- Returns one 1 per key, in order.
if #ARGV ~= 4 * #KEYS then
    return redis.error_reply('ERR celery_redlock log: expected age, event, cap and lifetime per key')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local done = {}
for i, key in ipairs(KEYS) do
    local ago, event = tonumber(ARGV[4 * i - 3]), ARGV[4 * i - 2]
    local cap, lifetime = tonumber(ARGV[4 * i - 1]), tonumber(ARGV[4 * i])
    if not ago or ago < 0 or ago > 1e12 or ago ~= math.floor(ago) then
        return redis.error_reply('ERR celery_redlock log: age must be a non-negative integer of ms')
    end
    if string.sub(event, 1, 1) ~= '{' or string.sub(event, -1) ~= '}' then
        return redis.error_reply('ERR celery_redlock log: an event must be a JSON object')
    end
    if not cap or cap < 1 or cap > 100000 or cap ~= math.floor(cap) then
        return redis.error_reply('ERR celery_redlock log: cap must be an integer from 1 to 100000')
    end
    if not lifetime or lifetime < 1 or lifetime > 1e12 or lifetime ~= math.floor(lifetime) then
        return redis.error_reply('ERR celery_redlock log: lifetime must be an integer of ms from 1 to 1e12')
    end
    local stamped = '{"t":' .. string.format('%d', now - ago)
    if event ~= '{}' then
        stamped = stamped .. ',' .. string.sub(event, 2)
    else
        stamped = stamped .. '}'
    end
    redis.call('LPUSH', key, stamped)
    redis.call('LTRIM', key, 0, cap - 1)
    redis.call('PEXPIRE', key, lifetime)
    done[i] = 1
end
return done
