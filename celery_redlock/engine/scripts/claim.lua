-- claim: reserve a lock name for one task id from send time (``lock_unique``).
--
-- A claim says "a copy of this task is queued (or running) under this task id":
-- apply_async takes it before publishing; the worker frees it when the copy starts
-- or finishes (celery_redlock.unique). Its TTL frees it when the copy is lost between
-- send and start (a purged queue, a broker failure).
--
-- KEYS[1]  claim hash of one task on one name (fields: task_id, task_name, claimed_at;
--          with debounce also due, the node's time in ms before which the copy may
--          not run, and args)
-- KEYS[2]  the name's execution lock hash (read only, with ARGV[8])
-- ARGV[1]  task id     ARGV[2]  TTL in milliseconds (positive integer)
-- ARGV[3]  task name   ARGV[4]  claimed-at, unix seconds on the client's clock (display)
-- ARGV[5]  task id of a holder to replace ('' for none): the caller saw that copy end
-- ARGV[6]  debounce in milliseconds ('' for none): a new claim, or a call that finds
--          another task id's claim, sets due = now + debounce and args = ARGV[7] (the
--          last call's arguments win) and refreshes the TTL
-- ARGV[7]  the call's arguments, serialized ('' without debounce)
-- ARGV[8]  '1': until_finished. With no claim to report, a copy of this task (task
--          name ARGV[3]) holding the execution lock holds the claim: it is running,
--          and its lease, renewed while it runs, is the claim's life then. Else ''.
--
-- Returns  {1}                  claimed
--          {2}                  this task id held it already; its TTL is refreshed
--          {0, holder, pttl}    held by another task id, for pttl more milliseconds
if #ARGV ~= 8 then
    return redis.error_reply('ERR celery_redlock claim: expected 8 arguments, got ' .. #ARGV)
end
if ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock claim: empty task id')
end
local MAX_LEASE = 2592000000
local ttl = tonumber(ARGV[2])
if not ttl or ttl <= 0 or ttl > MAX_LEASE or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock claim: TTL must be a positive integer of ms, at most 30 days')
end
local debounce = nil
if ARGV[6] ~= '' then
    debounce = tonumber(ARGV[6])
    if not debounce or debounce < 0 or debounce > MAX_LEASE or debounce ~= math.floor(debounce) then
        return redis.error_reply('ERR celery_redlock claim: debounce must be an integer of ms, 0 to 30 days')
    end
end
local function push_due()
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('HSET', KEYS[1], 'due', now + debounce, 'args', ARGV[7])
    redis.call('PEXPIRE', KEYS[1], ttl)
end
local holder = redis.call('HGET', KEYS[1], 'task_id')
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {2}
end
if holder and holder ~= ARGV[5] then
    if debounce then
        push_due()
        return {0, holder, ttl}
    end
    return {0, holder, redis.call('PTTL', KEYS[1])}
end
if ARGV[8] == '1' then
    local running = redis.call('HMGET', KEYS[2], 'task_id', 'task_name')
    if running[1] and running[1] ~= '' and running[1] ~= ARGV[1] and running[1] ~= ARGV[5]
            and running[2] == ARGV[3] then
        return {0, running[1], redis.call('PTTL', KEYS[2])}
    end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'task_name', ARGV[3], 'claimed_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
if debounce then
    push_due()
end
return {1}
