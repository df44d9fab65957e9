-- throttle: admit one run of a key per window (lock_throttle), measured on the node.
--
-- KEYS[1]  throttle   the key's last admission (string: task id, expiring with the
--                     window)
-- ARGV[1]  task_id    task id
-- ARGV[2]  window_ms  window in milliseconds (positive integer)
--
-- Returns  {1}          admitted; the window starts now
--          {0, wait_ms}  another run was admitted less than a window ago: wait_ms left
--                        (the same task id admitted again, a redelivery, is admitted)
local task_id, window_ms = ARGV[1], ARGV[2]
if task_id == nil or task_id == '' then
    return redis.error_reply('ERR celery_redlock throttle: empty task id')
end
local window = tonumber(window_ms)
if not window or window <= 0 or window > 2592000000 or window ~= math.floor(window) then
    return redis.error_reply('ERR celery_redlock throttle: window must be a positive integer of ms, at most 30 days')
end
local last = redis.call('GET', KEYS[1])
if last and last ~= task_id then
    return {0, math.max(1, redis.call('PTTL', KEYS[1]))}
end
if not last then
    redis.call('SET', KEYS[1], task_id, 'PX', window)
end
return {1}
