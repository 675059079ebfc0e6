
-- name: SlidingWindowTake :one
-- SlidingWindowTake checks and counts cost units for the key in one statement.
-- The row holds the current window's count and the previous window's; the
-- estimate for the sliding window that ends now is
--   prev_count * (window - elapsed) / window + count
-- where elapsed is how far now is into the current window. The check is
-- allowed when estimate + cost <= max_count (compared exactly, in numeric).
-- When a new window has begun the row rolls forward: count becomes prev_count
-- if the row's window was the one just before, else both restart at zero. A
-- denied check adds nothing unless penalty is set; a penalised count stops at
-- the largest bigint. The sliding window's step at a window start
-- (pgrl_sliding_window_take_at, migrations 000012 and 000022) decides; the
-- update arm reads the check's instant and its window's start from the
-- proposed row (excluded.updated_at, excluded.window_start), so that the
-- start is not computed again from the instant wherever the step rolls the
-- row forward, and calls only IMMUTABLE functions, as a distributed
-- PostgreSQL (Citus) requires. The insert arm's key has no counts, so the
-- step's verdict does not depend on the window start it is given: the
-- instant stands in for it (the planner would not inline the step given the
-- start computed there). at pins the clock for tests; production leaves it
-- nil. Windows start at multiples of window_us since the Unix epoch, floored
-- (also before 1970). Instants are returned as microseconds since the Unix
-- epoch, shaped by no session setting; now_us is the check's instant, kept
-- in the row's updated_at.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at)
VALUES (sqlc.arg(key)::bytea,
        pgrl_from_epoch_us(pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                sqlc.arg(window_us)::bigint)),
        (pgrl_sliding_window_take_at(NULL, 0, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                     pgrl_now_us(sqlc.narg(at)::timestamptz),
                                     sqlc.arg(window_us)::bigint,
                                     sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                     false)).count,
        0,
        pgrl_from_epoch_us(pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                sqlc.arg(window_us)::bigint) + 2 * sqlc.arg(window_us)::bigint),
        (pgrl_sliding_window_take_at(NULL, 0, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                     pgrl_now_us(sqlc.narg(at)::timestamptz),
                                     sqlc.arg(window_us)::bigint,
                                     sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                     false)).allowed,
        pgrl_now(sqlc.narg(at)::timestamptz))
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us),
       count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).count,
       prev_count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING pgrl_us(window_start) AS window_start_us, count, prev_count, allowed,
          pgrl_us(updated_at) AS now_us;

-- name: SlidingWindowPeek :one
-- SlidingWindowPeek reports the key's current and previous window counts as
-- of now, rolled forward as a check would, without counting anything.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts) AS c
), win AS MATERIALIZED (
    -- MATERIALIZED keeps window_start a column: pgrl_sliding_window_previous
    -- reads it twice, and PostgreSQL inlines a function only when an argument
    -- it reads twice is cheap.
    SELECT clock.now_us,
           pgrl_from_epoch_us(pgrl_window_start_us(clock.now_us, sqlc.arg(window_us)::bigint)) AS window_start
      FROM clock
), r AS (
    SELECT t.window_start, t.count, t.prev_count
      FROM pgrl_sliding_window AS t
     WHERE t.key = sqlc.arg(key)::bytea
)
SELECT pgrl_epoch_us(greatest(win.window_start, coalesce((SELECT r.window_start FROM r), win.window_start)))
           AS window_start_us,
       coalesce((SELECT pgrl_sliding_window_current(r.window_start, win.window_start, r.count) FROM r), 0)::bigint
           AS count,
       coalesce((SELECT pgrl_sliding_window_previous(r.window_start, win.window_start, sqlc.arg(window_us)::bigint,
                                                     r.count, r.prev_count)
                   FROM r), 0)::bigint AS prev_count,
       win.now_us::bigint AS now_us
  FROM win;

-- name: SlidingWindowReset :execrows
-- SlidingWindowReset forgets the key's counts.
DELETE FROM pgrl_sliding_window WHERE key = sqlc.arg(key)::bytea;

-- name: SlidingWindowTakeUpTo :one
-- SlidingWindowTakeUpTo is a partial grant: it counts as many of n units as
-- the weighted estimate admits (possibly none, which is a denial) and
-- returns that number as granted. n is a ceiling, not a cost: an n above
-- max_count is taken as max_count (migration 000010). Under penalty the ask
-- (n, at most max_count) is counted.
SELECT q.granted::bigint AS granted, q.window_start_us::bigint AS window_start_us, q.count::bigint AS count,
       q.prev_count::bigint AS prev_count, q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
  FROM pgrl_sliding_window_take_queue(ARRAY[sqlc.arg(key)::bytea], ARRAY[sqlc.arg(n)::bigint], ARRAY[true],
                                      ARRAY[1], ARRAY[sqlc.arg(max_count)::bigint], ARRAY[sqlc.arg(window_us)::bigint],
                                      ARRAY[sqlc.arg(penalty)::boolean], sqlc.narg(at)::timestamptz) AS q;
