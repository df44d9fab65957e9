-- renew_many: extend the lease of every hold this process has on a node, in one call.
--
-- KEYS[1..n]   holds*   the key of each hold i: a lock hash, a shared set or a
--                       holders hash
-- ARGV[1..3n]  leases*  three per hold i, in the order of the keys: its owner token,
--                       its new lease in milliseconds (positive integer), and its kind:
--                       'x' an exclusive hold (lock hash), 's' a share (the shared
--                       set), 'd' the shared holders' details (kept as long as a share)
--
-- The kind is data of each hold, not a mode of the call: one call renews every hold a
-- process has on a node, whatever its kind (a script per kind would cost a renewal one
-- call per kind), and each kind's key is renewed the one way its type allows.
--
-- Returns one code per key, in order:
--           1  renewed
--           0  gone (expired or released): the lease is lost
--          -1  held by another token: the lease is lost
if #ARGV ~= 3 * #KEYS then
    return redis.error_reply('ERR celery_redlock renew_many: expected token, lease and kind per key')
end
for i = 1, #KEYS do
    local ttl = tonumber(ARGV[3 * i - 1])
    if not ttl or ttl <= 0 or ttl ~= math.floor(ttl) then
        return redis.error_reply('ERR celery_redlock renew_many: lease must be a positive integer of ms')
    end
    local kind = ARGV[3 * i]
    if kind ~= 'x' and kind ~= 's' and kind ~= 'd' then
        return redis.error_reply("ERR celery_redlock renew_many: kind must be 'x', 's' or 'd'")
    end
end
local now
local codes = {}
for i, key in ipairs(KEYS) do
    local token, ttl = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1])
    if ARGV[3 * i] == 'x' then
        local current = redis.call('HMGET', key, 'token', 'ttl')
        if current[1] == false then
            codes[i] = 0
        elseif current[1] == token then
            redis.call('PEXPIRE', key, ttl)
            if current[2] ~= ARGV[3 * i - 1] then
                -- Written only when it changes: a write is replicated and logged.
                redis.call('HSET', key, 'ttl', ttl)
            end
            codes[i] = 1
        else
            codes[i] = -1
        end
    elseif ARGV[3 * i] == 'd' then
        if redis.call('HEXISTS', key, token) == 0 then
            codes[i] = 0
        else
            if redis.call('PTTL', key) < ttl then
                redis.call('PEXPIRE', key, ttl)
            end
            codes[i] = 1
        end
    else
        if not now then
            local t = redis.call('TIME')
            now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        end
        local deadline = tonumber(redis.call('ZSCORE', key, token))
        if not deadline or deadline <= now then
            codes[i] = 0  -- the next acquisition on this resource drops it
        else
            redis.call('ZADD', key, now + ttl, token)
            if redis.call('PTTL', key) < ttl then
                redis.call('PEXPIRE', key, ttl)
            end
            codes[i] = 1
        end
    end
end
return codes
