-- renew_many: extend the lease of every (key, token) pair this process holds, in one call.
--
-- KEYS[i]      lock hash i
-- ARGV[2i-1]   owner token of lock i
-- ARGV[2i]     new lease of lock i in milliseconds (positive integer)
--
-- Returns one code per key, in order:
--           1  renewed
--           0  gone (expired or released): the lease is lost
--          -1  held by another token: the lease is lost
if #ARGV ~= 2 * #KEYS then
    return redis.error_reply('ERR celery_redlock renew_many: expected one token and one lease per key')
end
for i = 1, #KEYS do
    local ttl = tonumber(ARGV[2 * i])
    if not ttl or ttl <= 0 or ttl ~= math.floor(ttl) then
        return redis.error_reply('ERR celery_redlock renew_many: lease must be a positive integer of ms')
    end
end
local codes = {}
for i, key in ipairs(KEYS) do
    local token = ARGV[2 * i - 1]
    local ttl = ARGV[2 * i]
    local current = redis.call('HGET', key, 'token')
    if current == false then
        codes[i] = 0
    elseif current == token then
        redis.call('PEXPIRE', key, ttl)
        redis.call('HSET', key, 'ttl', ttl)
        codes[i] = 1
    else
        codes[i] = -1
    end
end
return codes
