-- name: SlidingWindowTake :one
-- SlidingWindowTake checks and counts cost units for the key in one statement.
-- The row holds the current window's count and the previous window's; the
-- estimate for the sliding window that ends now is
--   prev_count * (window - elapsed) / window + count
-- where elapsed is how far now is into the current window. The check is
-- allowed when estimate + cost <= max_count (compared exactly, in numeric).
-- When a new window has begun the row rolls forward: count becomes prev_count
-- if the row's window was the one just before, else both restart at zero. A
-- denied check adds nothing unless penalty is set. The UPDATE arm reads the
-- current window's start from the proposed row; the rolled-forward counts,
-- the elapsed time and the comparison are the pgrl_sliding_window_*
-- functions of migration 000005, inlined by the planner. at pins the clock
-- for tests; production leaves it nil. Windows start at multiples of
-- window_us since the Unix epoch, floored (also before 1970); a penalised
-- count stops at the largest bigint. Instants are returned as microseconds
-- since the Unix epoch, shaped by no session setting.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts) AS c
), win AS (
    SELECT clock.now_us,
           pgrl_from_epoch_us(pgrl_window_start_us(clock.now_us, sqlc.arg(window_us)::bigint)) AS window_start
      FROM clock
)
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
SELECT sqlc.arg(key)::bytea,
       win.window_start,
       CASE WHEN sqlc.arg(cost)::bigint <= sqlc.arg(max_count)::bigint OR sqlc.arg(penalty)::boolean
            THEN sqlc.arg(cost)::bigint ELSE 0 END,
       0,
       win.window_start + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       sqlc.arg(cost)::bigint <= sqlc.arg(max_count)::bigint
  FROM win
ON CONFLICT (key) DO UPDATE
   SET window_start = greatest(t.window_start, excluded.window_start),
       count = pgrl_saturating_add(
                   pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                   CASE WHEN pgrl_sliding_window_allows(
                                 pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                              sqlc.arg(window_us)::bigint, t.count, t.prev_count),
                                 pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                                 sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(window_us)::bigint,
                                 pgrl_sliding_window_elapsed_us(
                                     pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())),
                                     greatest(t.window_start, excluded.window_start), sqlc.arg(window_us)::bigint))
                          OR sqlc.arg(penalty)::boolean
                        THEN sqlc.arg(cost)::bigint ELSE 0 END),
       prev_count = pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                 sqlc.arg(window_us)::bigint, t.count, t.prev_count),
       expires_at = greatest(t.window_start, excluded.window_start)
                    + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       allowed = pgrl_sliding_window_allows(
                     pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                  sqlc.arg(window_us)::bigint, t.count, t.prev_count),
                     pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                     sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(window_us)::bigint,
                     pgrl_sliding_window_elapsed_us(
                         pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())),
                         greatest(t.window_start, excluded.window_start), sqlc.arg(window_us)::bigint))
RETURNING pgrl_epoch_us(window_start) AS window_start_us, count, prev_count, allowed,
          (SELECT now_us FROM win)::bigint AS now_us;

-- name: SlidingWindowTakeMany :many
-- SlidingWindowTakeMany is SlidingWindowTake for several keys at once, under
-- the rules of FixedWindowTakeMany. The update arm reads the current
-- window's start from the proposed row's window_start and the cost from its
-- count.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts) AS c
), win AS (
    SELECT clock.now_us,
           pgrl_from_epoch_us(pgrl_window_start_us(clock.now_us, sqlc.arg(window_us)::bigint)) AS window_start
      FROM clock
)
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
SELECT (sqlc.arg(keys)::bytea[])[i],
       win.window_start,
       (sqlc.arg(costs)::bigint[])[i],
       0,
       win.window_start + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       (sqlc.arg(costs)::bigint[])[i] <= sqlc.arg(max_count)::bigint
  FROM win, generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET window_start = greatest(t.window_start, excluded.window_start),
       count = pgrl_saturating_add(
                   pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                   CASE WHEN pgrl_sliding_window_allows(
                                 pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                              sqlc.arg(window_us)::bigint, t.count, t.prev_count),
                                 pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                                 excluded.count, sqlc.arg(max_count)::bigint, sqlc.arg(window_us)::bigint,
                                 pgrl_sliding_window_elapsed_us(
                                     pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())),
                                     greatest(t.window_start, excluded.window_start), sqlc.arg(window_us)::bigint))
                          OR sqlc.arg(penalty)::boolean
                        THEN excluded.count ELSE 0 END),
       prev_count = pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                 sqlc.arg(window_us)::bigint, t.count, t.prev_count),
       expires_at = greatest(t.window_start, excluded.window_start)
                    + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       allowed = pgrl_sliding_window_allows(
                     pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                  sqlc.arg(window_us)::bigint, t.count, t.prev_count),
                     pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count),
                     excluded.count, sqlc.arg(max_count)::bigint, sqlc.arg(window_us)::bigint,
                     pgrl_sliding_window_elapsed_us(
                         pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())),
                         greatest(t.window_start, excluded.window_start), sqlc.arg(window_us)::bigint))
RETURNING encode(key, 'hex') AS key_hex, pgrl_epoch_us(window_start) AS window_start_us, count, prev_count,
          allowed, (SELECT now_us FROM win)::bigint AS now_us;

-- name: SlidingWindowPeek :one
-- SlidingWindowPeek reports the key's current and previous window counts as
-- of now, rolled forward as a check would, without counting anything.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts) AS c
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

-- name: SlidingWindowTakeQueue :many
-- SlidingWindowTakeQueue decides queues of checks, several per key, each
-- key's row locked, rolled forward and written once, under the rules of
-- FixedWindowTakeQueue: every check gets the row's state right after it, as
-- SlidingWindowTake would return it at the same instant. A partial grant
-- takes the most units the weighted estimate still admits, at most its
-- cost. See pgrl_sliding_window_take_queue (migrations 000006 and 000010).
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
       q.window_start_us::bigint AS window_start_us, q.count::bigint AS count, q.prev_count::bigint AS prev_count,
       q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
  FROM pgrl_sliding_window_take_queue(sqlc.arg(keys)::bytea[], sqlc.arg(costs)::bigint[],
                                      sqlc.arg(up_to)::boolean[], sqlc.arg(ends)::integer[],
                                      sqlc.arg(max_counts)::bigint[], sqlc.arg(windows_us)::bigint[],
                                      sqlc.arg(penalties)::boolean[], sqlc.narg(at)::timestamptz) AS q;

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

-- name: SlidingWindowTakePolicy :one
-- SlidingWindowTakePolicy is SlidingWindowTake with the limit stored in the
-- database, read in this same statement under the rules of
-- FixedWindowTakePolicy: no row comes back, and nothing is counted, when
-- the policy (with the key's override) no longer has window_us, is no
-- longer a sliding window, no longer stores keys in key_mode, or does not
-- exist. max_count is the limit that was applied.
WITH win AS MATERIALIZED (
    SELECT coalesce(o."limit", p."limit") AS max_count, p.penalty, sqlc.arg(cost)::bigint AS cost,
           sqlc.arg(window_us)::bigint AS window_us,
           pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())) AS now_us,
           pgrl_from_epoch_us(pgrl_window_start_us(pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())),
                                                   sqlc.arg(window_us)::bigint)) AS window_start
      FROM pgrl_policy AS p
      LEFT JOIN pgrl_policy_override AS o
        ON o.policy = p.name AND o.key = sqlc.arg(override_key)::bytea
       AND (o.expires_at IS NULL OR o.expires_at > coalesce(sqlc.narg(at)::timestamptz, now()))
     WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'sliding_window'
       AND p.key_mode = sqlc.arg(key_mode)::text
       AND round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint = sqlc.arg(window_us)::bigint
)
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
SELECT sqlc.arg(key)::bytea,
       win.window_start,
       CASE WHEN win.cost <= win.max_count OR win.penalty THEN win.cost ELSE 0 END,
       0,
       win.window_start + 2 * win.window_us * interval '1 microsecond',
       win.cost <= win.max_count
  FROM win
ON CONFLICT (key) DO UPDATE
   SET (window_start, count, prev_count, expires_at, allowed) = (
       SELECT r.start, pgrl_saturating_add(r.cur, CASE WHEN r.allows OR win.penalty THEN win.cost ELSE 0 END),
              r.prev, r.start + 2 * win.window_us * interval '1 microsecond', r.allows
         FROM win,
              LATERAL (SELECT greatest(t.window_start, excluded.window_start) AS start,
                              pgrl_sliding_window_current(t.window_start, excluded.window_start, t.count) AS cur,
                              pgrl_sliding_window_previous(t.window_start, excluded.window_start,
                                                           win.window_us, t.count, t.prev_count) AS prev) AS w,
              LATERAL (SELECT w.start, w.cur, w.prev,
                              pgrl_sliding_window_allows(
                                  w.prev, w.cur, win.cost, win.max_count, win.window_us,
                                  pgrl_sliding_window_elapsed_us(win.now_us, w.start, win.window_us)) AS allows) AS r)
RETURNING pgrl_epoch_us(window_start) AS window_start_us, count, prev_count, allowed,
          pgrl_epoch_us(coalesce(sqlc.narg(at)::timestamptz, now())) AS now_us,
          (SELECT max_count FROM win)::bigint AS max_count;
