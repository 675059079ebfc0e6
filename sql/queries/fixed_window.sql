
-- name: FixedWindowTake :one
-- FixedWindowTake counts cost units against the key's current window in one
-- statement and returns the window's state after the check: the key's row of
-- that window is inserted, or updated by the upsert's update arm, with what
-- the fixed window's step (pgrl_fixed_window_take, migration 000012) makes
-- of it. A check is allowed when count + cost <= max_count. A denied check
-- adds nothing, unless penalty is set: then every attempt is counted, the
-- count stopping at the largest bigint (a negative cost, which only direct
-- callers of this query pass, takes units back). Windows are aligned on the
-- database clock: multiples of window_us microseconds since the Unix epoch,
-- floored (also before 1970). Instants are returned as microseconds since
-- the Unix epoch, so that no session setting (DateStyle, TimeZone) shapes
-- them; now_us is the check's instant, kept in the row's updated_at. at pins
-- the clock for tests; production leaves it nil and the database's now()
-- decides: the transaction's start, which for a check sent on its own is the
-- statement's, and which gives every check of one multi-limit batch the same
-- instant. The statement is one INSERT ... VALUES whose update arm calls
-- only IMMUTABLE functions, reading the window from the proposed row
-- (excluded), as a distributed PostgreSQL (Citus) requires.
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
VALUES (sqlc.arg(key)::bytea,
        pgrl_from_epoch_us(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                              sqlc.arg(window_us)::bigint)),
        (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                   sqlc.arg(window_us)::bigint), 0,
                                sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                false)).count,
        (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                   sqlc.arg(window_us)::bigint), 0,
                                sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                false)).allowed,
        pgrl_now(sqlc.narg(at)::timestamptz))
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                       sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).count,
       allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                         sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING count, pgrl_us(expires_at) AS expires_at_us, allowed, pgrl_us(updated_at) AS now_us;

-- name: FixedWindowPeek :one
-- FixedWindowPeek reports the key's current window without counting anything.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts) AS c
), win AS (
    SELECT clock.now_us, pgrl_window_end_us(clock.now_us, sqlc.arg(window_us)::bigint) AS expires_us
      FROM clock
)
SELECT coalesce((SELECT t.count FROM pgrl_fixed_window AS t
                  WHERE t.key = sqlc.arg(key)::bytea
                    AND t.expires_at = pgrl_from_epoch_us(win.expires_us)), 0)::bigint AS count,
       win.expires_us::bigint AS expires_at_us,
       win.now_us::bigint AS now_us
  FROM win;

-- name: FixedWindowReset :execrows
-- FixedWindowReset forgets every window of the key.
DELETE FROM pgrl_fixed_window WHERE key = sqlc.arg(key)::bytea;

-- name: FixedWindowTakeUpTo :one
-- FixedWindowTakeUpTo is a partial grant: it takes as many of n units as
-- the key's window has left (possibly none, which is a denial) and returns
-- that number as granted, with the window's state after it. n is a ceiling,
-- not a cost: any n >= 1 is valid, and an n above max_count is taken as
-- max_count (migration 000010). Under penalty the ask is counted whatever is
-- granted: n, or max_count when n is above it.
SELECT q.granted::bigint AS granted, q.count::bigint AS count, q.allowed::boolean AS allowed,
       q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM pgrl_fixed_window_take_queue(ARRAY[sqlc.arg(key)::bytea], ARRAY[sqlc.arg(n)::bigint], ARRAY[true],
                                    ARRAY[1], ARRAY[sqlc.arg(max_count)::bigint], ARRAY[sqlc.arg(window_us)::bigint],
                                    ARRAY[sqlc.arg(penalty)::boolean], sqlc.narg(at)::timestamptz) AS q;
