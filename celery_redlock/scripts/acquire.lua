-- acquire: take the lock if it is free, or refresh it if this token holds it already.
--
-- KEYS[1]  lock hash (fields: token, fence, task_id, task_name, host, pid, acquired_at, ttl)
-- KEYS[2]  fence counter; never expires, so fences only grow for a key
-- ARGV[1]  owner token (128 random bits, new for every acquisition)
-- ARGV[2]  lease in milliseconds (positive integer)
-- ARGV[3]  holder task id ('' when the holder is not a task)
-- ARGV[4]  holder host name      ARGV[5] holder pid
-- ARGV[6]  acquired-at, unix seconds on the client's clock (display only)
-- ARGV[7]  holder task name ('' when the holder is not a task)
--
-- Returns  {1, fence}               acquired; fence is the new counter value
--          {2, fence}               this token already held it; lease refreshed
--          {0, pttl, holder_task}   held by another token
local ttl = tonumber(ARGV[2])
if not ttl or ttl <= 0 or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock acquire: lease must be a positive integer of ms')
end
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock acquire: empty owner token')
end
local current = redis.call('HGET', KEYS[1], 'token')
if current == false then
    local fence = redis.call('INCR', KEYS[2])
    redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, 'task_id', ARGV[3],
               'task_name', ARGV[7] or '', 'host', ARGV[4], 'pid', ARGV[5],
               'acquired_at', ARGV[6], 'ttl', ttl)
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {1, fence}
end
if current == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {2, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[1], 'task_id') or ''}
