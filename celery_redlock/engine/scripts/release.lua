-- release: delete the locks this token holds, and announce each release.
--
-- Three scripts run this file, told apart by the prelude's NAMING (never by an
-- argument), one per acquire script: release (''), release_wake and release_fair.
-- '': publish '' on each lock's channel (one waiter per subscribed process wakes).
-- 'fair' and 'wake': grant the lock to the oldest recorded waiter (a fair lock's head
-- of the queue), which leaves the record (wake.lua). A named waiter hears
-- it on its process channel alone; '' goes to the lock's channel only when nobody is
-- recorded.
--
-- KEYS[1..2n]  locks*   per resource i (i = 1..n): its lock hash, its release channel
-- KEYS[..]     record*  release_wake and release_fair (one resource, see wake.lua):
--                       queue, waiter deadlines, wake (the waiters' entries); none for
--                       release
-- KEYS[..]     fence*   with a record: the lock's fence counter (a grant's fence);
--                       none for release
-- ARGV[1]  token       owner token
-- ARGV[2]  reserve_ms  (with a record) a positive number: the next waiter is granted
--                      the lock (for the lease it recorded); 0: it is only named (it
--                      tries); else ignored
-- ARGV[3]  channel     ('wake') the releasing process's channel: when this release
--                      yields the process's turn (below), its own recorded waiters are
--                      passed over; else ignored
-- ARGV[4]  attempt     '' for a release. Else the undo of an acquisition attempt that
--                      lost the vote, by its number (a positive integer): a lock is
--                      deleted only if no later attempt of the token wrote or claimed
--                      it (its field 'attempt' is at most this one), so an undo that
--                      arrives late, behind the next attempt, cannot delete what that
--                      attempt counts; the token keeps its place in the record (it
--                      tries again), and the next waiter is named, not granted the lock
--
-- With a record, the token also leaves it (unless an undo: a Redlock holder this node
-- refused stays recorded here); a grant to it here (made by this node while it won on
-- others) is released as any lock of the token. A lock whose turn is over (field
-- 'yield', see acquire.lua) is granted to the oldest recorded waiter of another
-- process; with none recorded, it is reserved for 'yield' ms against the releasing
-- process (its host and pid) and free for any other, so that another process's woken
-- waiter gets it.
-- Returns  1  released (every lock was held by this token)
--          0  gone already (expired or released), wholly or in part
--         -1  a lock is held by another token (or, for an undo, by a later attempt of
--             this one): that one is left alone
local token, reserve_ms, channel, attempt = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if token == nil or token == '' then
    return redis.error_reply('ERR celery_redlock release: empty owner token')
end
if token == YIELD_MARK then
    return redis.error_reply('ERR celery_redlock release: the owner token is the reservation mark')
end
local reserve, wrong = 0, nil
if NAMING ~= '' then
    reserve, wrong = naming_args(NAMING, reserve_ms)
end
if not reserve then
    return redis.error_reply('ERR celery_redlock release: ' .. wrong)
end
local record = NAMING ~= ''
if record and #KEYS ~= 6 then
    return redis.error_reply('ERR celery_redlock release: a record of waiters takes 6 keys')
end
local undo = nil
if attempt ~= nil and attempt ~= '' then
    undo = tonumber(attempt)
    if not undo or undo < 1 or undo > 9007199254740991 or undo ~= math.floor(undo) then
        return redis.error_reply('ERR celery_redlock release: an attempt number must be a positive integer')
    end
end
local parts = {KEYS[3], KEYS[4], KEYS[5]}

-- Name the next waiter of a freed lock (with a record), granting it the lock unless
-- `cap` (a third of the released lease) is 0; nil when nobody is recorded.
local function name_after(lock, cap, skip)
    if not record then
        return nil
    end
    return name_next(lock, KEYS[6], KEYS[2], parts, NAMING, math.min(reserve, cap), skip)
end

if record and not undo then
    leave(parts, token)
end
local n = record and 1 or #KEYS / 2
local released, taken = 0, false
for i = 1, n do
    local lock = KEYS[2 * i - 1]
    local fields = redis.call('HMGET', lock, 'token', 'yield', 'host', 'pid', 'fence', 'ttl',
                              'attempt')
    local held = {yield = tonumber(fields[2]), host = fields[3], pid = fields[4],
                  fence = fields[5], ttl = fields[6]}
    if fields[1] == token and undo and (tonumber(fields[7]) or 0) > undo then
        taken = true  -- written or claimed by a later attempt of this token: it counts it
    elseif fields[1] == token then
        redis.call('DEL', lock)
        local skip = held.yield and channel ~= nil and channel ~= '' and channel
        -- An undo names the next waiter but grants it nothing: the split vote's other
        -- voters are the waiters it would name, and each undo would hand its node to the
        -- other (two voters on two nodes swapped theirs at every retry, with the third
        -- node slow: no acquisition for seconds). Free, the node goes to the first to
        -- come back after its random pause.
        local cap = undo and 0 or math.floor((tonumber(held.ttl) or 0) / 3)
        local named = name_after(lock, cap, skip)
        if held.yield and held.host and held.pid and redis.call('EXISTS', lock) == 0 then
            redis.call('HSET', lock, 'token', YIELD_MARK, 'host', held.host, 'pid', held.pid,
                       'fence', held.fence or '0', 'ttl', held.yield)
            redis.call('PEXPIRE', lock, held.yield)
        end
        if not named then
            redis.call('PUBLISH', KEYS[2 * i], '')
        end
        released = released + 1
    elseif fields[1] then
        taken = true
    end
end
local code = released == n and 1 or 0
if taken then
    code = -1
end
return code
