-- window: a library put in front of the scripts that judge a rate budget's log
-- (rate, budget_read), after the prelude; not a script of its own.
--
-- span_us(window, limit)  how long, in microseconds, a start stays in the window of a
--          budget of `limit` starts per `window` ms: the window and a guard. Its body
--          starts a few ms after its admission, and one body later than the next at
--          times (a process scheduled later); the guard (10 ms at most, half a slot
--          for fast budgets) keeps the bodies' starts, not only their admissions,
--          within N per window.
local function span_us(window, limit)
    return window * 1000 + math.floor(math.min(10000, window * 500 / limit))
end
