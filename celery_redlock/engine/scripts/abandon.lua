-- abandon: refuse a token from now on (for one lease): its acquisition was given up
-- with a request that may still be on its way to this node.
--
-- An acquisition cut short (an asynchronous exception, a cancellation, a node that did
-- not answer within the budget) cannot know whether its request has reached the node:
-- the connection that carried it was closed or timed out, and the undo goes out on
-- another connection, which may arrive first. acquire.lua and acquire_shared.lua refuse
-- a token listed here, so a request that arrives later grants nothing; the release
-- sent right behind this call frees what an earlier arrival granted.
--
-- KEYS[1]  abandoned  the lock's abandoned tokens (sorted set token -> expiry, node
--                     clock, ms)
-- ARGV[1]  token      the token
-- ARGV[2]  ttl_ms     how long to refuse it, in ms (the lease it asked for)
--
-- Returns  1
if #KEYS ~= 1 or #ARGV ~= 2 then
    return redis.error_reply('ERR celery_redlock abandon: expected 1 key and 2 arguments')
end
local token, ttl_ms = ARGV[1], ARGV[2]
local ttl = tonumber(ttl_ms)
if not ttl or ttl <= 0 or ttl > 2592000000 or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock abandon: lease must be a positive integer of ms, at most 30 days')
end
if token == '' then
    return redis.error_reply('ERR celery_redlock abandon: empty owner token')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Entries whose lease is over are dropped, so the set holds one lease of abandons.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, token)
if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
