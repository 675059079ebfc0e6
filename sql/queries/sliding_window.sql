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
-- the largest bigint. The sliding window's step (pgrl_sliding_window_take,
-- migration 000012) decides; the update arm reads the check's instant from
-- the proposed row (excluded.updated_at) and calls only IMMUTABLE functions,
-- as a distributed PostgreSQL (Citus) requires. at pins the clock for tests;
-- production leaves it nil. Windows start at multiples of window_us since
-- the Unix epoch, floored (also before 1970). Instants are returned as
-- microseconds since the Unix epoch, shaped by no session setting; now_us is
-- the check's instant, kept in the row's updated_at.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at)
VALUES (sqlc.arg(key)::bytea,
        pgrl_from_epoch_us(pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                sqlc.arg(window_us)::bigint)),
        (pgrl_sliding_window_take(NULL, 0, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                  sqlc.arg(window_us)::bigint,
                                  sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                  false)).count,
        0,
        pgrl_from_epoch_us(pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                sqlc.arg(window_us)::bigint) + 2 * sqlc.arg(window_us)::bigint),
        (pgrl_sliding_window_take(NULL, 0, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                  sqlc.arg(window_us)::bigint,
                                  sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                  false)).allowed,
        pgrl_now(sqlc.narg(at)::timestamptz))
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us),
       count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).count,
       prev_count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING pgrl_us(window_start) AS window_start_us, count, prev_count, allowed,
          pgrl_us(updated_at) AS now_us;

-- name: SlidingWindowTakeMany :many
-- SlidingWindowTakeMany is SlidingWindowTake for several keys at once, under
-- the rules of FixedWindowTakeMany: the update arm reads each check's cost
-- back from the proposed row's count (or, when the cost alone is over
-- max_count, any such cost, which decides the same). Its figures sit in an
-- unflattened one-row subquery, as FixedWindowTakeMany's do.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at)
SELECT (sqlc.arg(keys)::bytea[])[i] AS key, pgrl_from_epoch_us(p.start_us) AS window_start, s.count,
       0::bigint AS prev_count, pgrl_from_epoch_us(p.start_us + 2 * p.window_us) AS expires_at, s.allowed,
       p.ts AS updated_at
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us,
               pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz), sqlc.arg(window_us)::bigint) AS start_us,
               sqlc.arg(window_us)::bigint AS window_us, sqlc.arg(max_count)::bigint AS max_count,
               sqlc.arg(penalty)::boolean AS penalty
        OFFSET 0) AS p,
       generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i,
       LATERAL pgrl_sliding_window_take(NULL, 0, 0, p.now_us, p.window_us, (sqlc.arg(costs)::bigint[])[i],
                                        p.max_count, p.penalty, false) AS s
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                             ELSE 9223372036854775807 END, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us),
       count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                             ELSE 9223372036854775807 END, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).count,
       prev_count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                             ELSE 9223372036854775807 END, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                             ELSE 9223372036854775807 END, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                             ELSE 9223372036854775807 END, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING encode(key, 'hex') AS key_hex, pgrl_us(window_start) AS window_start_us, count, prev_count,
          allowed, pgrl_us(updated_at) AS now_us;

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
-- exist. max_count is the limit that was applied. As there, the update arm
-- reads the figures from the proposed row.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at,
                                      policy_limit, policy_penalty)
SELECT sqlc.arg(key)::bytea, pgrl_from_epoch_us(f.start_us),
       (pgrl_sliding_window_take(NULL, 0, 0, f.now_us, sqlc.arg(window_us)::bigint, sqlc.arg(cost)::bigint,
                                 f.max_count, f.penalty, false)).count,
       0,
       pgrl_from_epoch_us(f.start_us + 2 * sqlc.arg(window_us)::bigint),
       (pgrl_sliding_window_take(NULL, 0, 0, f.now_us, sqlc.arg(window_us)::bigint, sqlc.arg(cost)::bigint,
                                 f.max_count, f.penalty, false)).allowed,
       f.ts, f.max_count, f.penalty
  FROM (SELECT coalesce(o."limit", p."limit") AS max_count, p.penalty, pgrl_now(sqlc.narg(at)::timestamptz) AS ts,
               pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us,
               pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz), sqlc.arg(window_us)::bigint) AS start_us
          FROM pgrl_policy AS p
          LEFT JOIN pgrl_policy_override AS o
            ON o.policy = p.name AND o.key = sqlc.arg(override_key)::bytea
           AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
         WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'sliding_window'
           AND p.key_mode = sqlc.arg(key_mode)::text
           AND round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint
               = sqlc.arg(window_us)::bigint) AS f
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us),
       count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).count,
       prev_count = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = (pgrl_sliding_window_take(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).allowed,
       updated_at = excluded.updated_at,
       policy_limit = excluded.policy_limit,
       policy_penalty = excluded.policy_penalty
RETURNING pgrl_us(window_start) AS window_start_us, count, prev_count, allowed,
          pgrl_us(updated_at) AS now_us,
          policy_limit::bigint AS max_count;
