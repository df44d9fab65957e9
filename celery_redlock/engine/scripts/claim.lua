-- claim: reserve a lock name for one task id from send time (``lock_unique``).
--
-- A claim says "a copy of this task is queued (or running) under this task id":
-- apply_async takes it before publishing; the worker frees it when the copy starts
-- or finishes (celery_redlock.unique). Its TTL frees it when the copy is lost between
-- send and start (a purged queue, a broker failure).
--
-- KEYS[1]  claim hash (fields: task_id, task_name, claimed_at)
-- ARGV[1]  task id     ARGV[2]  TTL in milliseconds (positive integer)
-- ARGV[3]  task name   ARGV[4]  claimed-at, unix seconds on the client's clock (display)
-- ARGV[5]  task id of a holder to replace ('' for none): the caller saw that copy end
--
-- Returns  {1}                  claimed
--          {2}                  this task id held it already; its TTL is refreshed
--          {0, holder, pttl}    held by another task id, for pttl more milliseconds
if #ARGV ~= 5 then
    return redis.error_reply('ERR celery_redlock claim: expected 5 arguments, got ' .. #ARGV)
end
if ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock claim: empty task id')
end
local MAX_LEASE = 2592000000
local ttl = tonumber(ARGV[2])
if not ttl or ttl <= 0 or ttl > MAX_LEASE or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock claim: TTL must be a positive integer of ms, at most 30 days')
end
local holder = redis.call('HGET', KEYS[1], 'task_id')
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {2}
end
if holder and holder ~= ARGV[5] then
    return {0, holder, redis.call('PTTL', KEYS[1])}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'task_name', ARGV[3], 'claimed_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
return {1}
