-- claim: reserve a lock name for one task id from send time (``lock_unique``).
--
-- A claim says "a copy of this task is queued (or running) under this task id":
-- apply_async takes it before publishing; the worker frees it when the copy starts
-- or finishes (celery_redlock.unique). Its TTL frees it when the copy is lost between
-- send and start (a purged queue, a broker failure).
--
-- KEYS[1]  claim        claim hash of one task on one name (fields: task_id,
--                        task_name, claimed_at; with debounce also due, the node's
--                        time in ms before which the copy may not run, and args)
-- KEYS[2]  lock         the name's execution lock hash (read only, with running)
-- ARGV[1]  task_id      task id
-- ARGV[2]  ttl_ms       TTL in milliseconds (positive integer)
-- ARGV[3]  task_name    task name
-- ARGV[4]  claimed_at   unix seconds on the client's clock (display)
-- ARGV[5]  replace      task id of a holder to replace ('' for none): the caller saw
--                       that copy end
-- ARGV[6]  debounce_ms  debounce in milliseconds ('' for none): a new claim, or a call
--                       that finds another task id's claim, sets due = now + debounce
--                       and args = args (the last call's arguments win) and refreshes
--                       the TTL
-- ARGV[7]  args         the call's arguments, serialized ('' without debounce)
-- ARGV[8]  running      '1': until_finished. With no claim to report, a copy of this
--                       task (task_name) holding the execution lock holds the claim:
--                       it is running, and its lease, renewed while it runs, is the
--                       claim's life then. Else ''. A flag of the one algorithm (one
--                       more holder to report), not a mode between two.
--
-- Returns  {1}                  claimed
--          {2}                  this task id held it already; its TTL is refreshed
--          {0, holder, pttl}    held by another task id, for pttl more milliseconds
if #ARGV ~= 8 then
    return redis.error_reply('ERR celery_redlock claim: expected 8 arguments, got ' .. #ARGV)
end
local task_id, ttl_ms, task_name, claimed_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local replace, debounce_ms, args, running = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
if task_id == '' then
    return redis.error_reply('ERR celery_redlock claim: empty task id')
end
local MAX_LEASE = 2592000000
local ttl = tonumber(ttl_ms)
if not ttl or ttl <= 0 or ttl > MAX_LEASE or ttl ~= math.floor(ttl) then
    return redis.error_reply('ERR celery_redlock claim: TTL must be a positive integer of ms, at most 30 days')
end
local debounce = nil
if debounce_ms ~= '' then
    debounce = tonumber(debounce_ms)
    if not debounce or debounce < 0 or debounce > MAX_LEASE or debounce ~= math.floor(debounce) then
        return redis.error_reply('ERR celery_redlock claim: debounce must be an integer of ms, 0 to 30 days')
    end
end
local function push_due()
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('HSET', KEYS[1], 'due', now + debounce, 'args', args)
    redis.call('PEXPIRE', KEYS[1], ttl)
end
local holder = redis.call('HGET', KEYS[1], 'task_id')
if holder == task_id then
    redis.call('PEXPIRE', KEYS[1], ttl)
    return {2}
end
if holder and holder ~= replace then
    if debounce then
        push_due()
        return {0, holder, ttl}
    end
    return {0, holder, redis.call('PTTL', KEYS[1])}
end
if running == '1' then
    local current = redis.call('HMGET', KEYS[2], 'task_id', 'task_name')
    if current[1] and current[1] ~= '' and current[1] ~= task_id and current[1] ~= replace
            and current[2] == task_name then
        return {0, current[1], redis.call('PTTL', KEYS[2])}
    end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'task_id', task_id, 'task_name', task_name, 'claimed_at', claimed_at)
redis.call('PEXPIRE', KEYS[1], ttl)
if debounce then
    push_due()
end
return {1}
