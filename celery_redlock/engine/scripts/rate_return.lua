-- rate_return: give back a start that rate.lua admitted but that will not happen
-- (a majority refused it; the run it was for did not start).
--
-- KEYS[1]  rate    the key's starts (sorted set, see rate.lua)
-- ARGV[1]  member  the start's member
--
-- Returns  1  given back
--          0  not logged (never admitted here, or already out of the window)
local member = ARGV[1]
if member == nil or member == '' then
    return redis.error_reply('ERR celery_redlock rate_return: empty member')
end
return redis.call('ZREM', KEYS[1], member)
