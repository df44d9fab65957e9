-- release: delete the locks this token holds, and announce each release.
--
-- KEYS[2i-1]  lock hash of resource i (i = 1..n)   KEYS[2i]  its release channel
-- With a record of waiters (ARGV[2] 'fair' or 'wake', one resource, see wake.lua):
--             KEYS[3] queue, KEYS[4] waiter deadlines, KEYS[5] wake (process channels),
--             KEYS[6] grant (holder fields), KEYS[7] fence counter, KEYS[8] abandoned
--             tokens: a waiter that recorded its holder fields is granted the lock in
--             place (wake.lua name_next), unless its token was abandoned
-- ARGV[1]     owner token
-- ARGV[2]     '' (or absent): publish '' on each KEYS[2i] (one waiter per subscribed
--             process wakes). 'fair': name the head of the queue, which keeps its
--             place. 'wake': name the oldest recorded waiter, which leaves the record,
--             and reserve the lock for it (wake.lua). A named waiter hears it on its
--             process channel alone; '' goes to KEYS[2] only when nobody is recorded.
-- ARGV[3]     ('wake') the reservation, in ms (non-negative integer); at most a third
--             of the released lease (the default renewal interval) is used
-- ARGV[4]     ('wake') the releasing process's channel: when this release yields the
--             process's turn (below), its own recorded waiters are passed over
-- ARGV[5]     optional: 'keep', the undo of an attempt that lost the vote: the token
--             keeps its place in the record (it tries again)
-- ARGV[6]     optional: 'local', the releaser wakes a waiter of its own process (ARGV[4])
--             itself: a grant to one is not published, and the reply says whom it
--             granted (below)
--
-- With a record, the token also leaves it, unless 'keep' (a Redlock holder this node
-- refused stays recorded here), and a reservation made for it here (named by this
-- node while it won on others) is passed on to the next waiter, as fair_leave.lua does.
-- A lock whose turn is over (field 'yield', see acquire.lua) is reserved for the oldest
-- recorded waiter of another process; with none recorded, it is reserved for 'yield' ms
-- against the releasing process (its host and pid) and free for any other, so that
-- another process's woken waiter gets it.
-- Returns  1  released (every lock was held by this token)
--          0  gone already (expired or released), wholly or in part
--         -1  a lock is held by another token: that one is left alone
--         {code, token, fence}  with 'local', when the lock was granted to a waiter of
--             the releasing process: the code above, that waiter's token and its fence
if ARGV[1] == nil or ARGV[1] == '' then
    return redis.error_reply('ERR celery_redlock release: empty owner token')
end
if ARGV[1] == YIELD_MARK then
    return redis.error_reply('ERR celery_redlock release: the owner token is the reservation mark')
end
local token = ARGV[1]
local how = ARGV[2] or ''
local reserve, wrong = 0, nil
if how ~= '' then
    reserve, wrong = naming_args(how, ARGV[3])
end
if not reserve then
    return redis.error_reply('ERR celery_redlock release: ' .. wrong)
end
local record = how ~= ''
if record and #KEYS ~= 8 then
    return redis.error_reply('ERR celery_redlock release: a record of waiters takes 8 keys')
end
local parts = {KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
local here = ARGV[6] == 'local' and ARGV[4] ~= '' and ARGV[4] or nil
local granted_here = nil  -- {token, fence} of a waiter of this process granted the lock

-- Name the next waiter of a freed lock (with a record), keeping the lock for it at most
-- `cap` ms; nil when nobody is recorded.
local function name_after(lock, held, cap, skip)
    if not record then
        return nil
    end
    local named, fence = name_next(lock, KEYS[2], parts, how, math.min(reserve, cap), skip,
                                   held.fence or '0', {KEYS[7], KEYS[8], here})
    if fence then
        granted_here = {named, fence_text(fence)}
    end
    return named
end

if record and ARGV[5] ~= 'keep' then
    leave(parts, token)
end
local n = record and 1 or #KEYS / 2
local released, taken = 0, false
for i = 1, n do
    local lock = KEYS[2 * i - 1]
    local fields = redis.call('HMGET', lock, 'token', 'yield', 'host', 'pid', 'fence', 'ttl', 'for')
    local held = {yield = tonumber(fields[2]), host = fields[3], pid = fields[4],
                  fence = fields[5], ttl = fields[6]}
    if fields[1] == token then
        redis.call('DEL', lock)
        local skip = held.yield and ARGV[4] ~= nil and ARGV[4] ~= '' and ARGV[4]
        local named = name_after(lock, held, math.floor((tonumber(held.ttl) or 0) / 3), skip)
        if held.yield and held.host and held.pid and redis.call('EXISTS', lock) == 0 then
            redis.call('HSET', lock, 'token', YIELD_MARK, 'host', held.host, 'pid', held.pid,
                       'fence', held.fence or '0', 'ttl', held.yield)
            redis.call('PEXPIRE', lock, held.yield)
        end
        if not named then
            redis.call('PUBLISH', KEYS[2 * i], '')
        end
        released = released + 1
    elseif fields[1] == YIELD_MARK and record and fields[7] == token then
        -- Kept here for this token, which no longer wants it: pass it on.
        redis.call('DEL', lock)
        if not name_after(lock, held, tonumber(held.ttl) or 0, false) then
            redis.call('PUBLISH', KEYS[2 * i], '')
        end
    elseif fields[1] then
        taken = true
    end
end
local code = released == n and 1 or 0
if taken then
    code = -1
end
if granted_here then
    return {code, granted_here[1], granted_here[2]}
end
return code
