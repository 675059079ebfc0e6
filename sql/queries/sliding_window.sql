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
-- current window's start from the proposed row and spells the rolled-forward
-- counts out where it needs them, as TokenBucketTake does. at pins the clock
-- for tests; production leaves it nil. Windows start at multiples of
-- window_us since the Unix epoch, floored (also before 1970); a penalised
-- count stops at the largest bigint. Instants are returned as microseconds
-- since the Unix epoch, shaped by no session setting.
WITH p AS (
    SELECT n.ts, n.now_us,
           timestamptz 'epoch' + (n.now_us - ((n.now_us % n.window_us) + n.window_us) % n.window_us) * interval '1 microsecond' AS window_start,
           n.window_us, n.cost, n.max_count, n.penalty
      FROM (SELECT c.ts, (extract(epoch FROM c.ts) * 1000000)::bigint AS now_us,
                   c.window_us, c.cost, c.max_count, c.penalty
              FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
                           sqlc.arg(window_us)::bigint AS window_us,
                           sqlc.arg(cost)::bigint AS cost,
                           sqlc.arg(max_count)::bigint AS max_count,
                           sqlc.arg(penalty)::boolean AS penalty) AS c) AS n
)
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
SELECT sqlc.arg(key)::bytea,
       p.window_start,
       CASE WHEN p.cost <= p.max_count OR p.penalty THEN p.cost ELSE 0 END,
       0,
       p.window_start + 2 * p.window_us * interval '1 microsecond',
       p.cost <= p.max_count
  FROM p
ON CONFLICT (key) DO UPDATE
   SET window_start = greatest(t.window_start, excluded.window_start),
       count = least((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric
               + CASE WHEN (CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END)::numeric * (sqlc.arg(window_us)::bigint - least(greatest((extract(epoch FROM coalesce(sqlc.narg(at)::timestamptz, now())) * 1000000)::bigint - (extract(epoch FROM greatest(t.window_start, excluded.window_start)) * 1000000)::bigint, 0), sqlc.arg(window_us)::bigint))
                           + ((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric + sqlc.arg(cost)::bigint) * sqlc.arg(window_us)::bigint
                           <= sqlc.arg(max_count)::bigint::numeric * sqlc.arg(window_us)::bigint
                        OR sqlc.arg(penalty)::boolean
                      THEN sqlc.arg(cost)::bigint ELSE 0 END, 9223372036854775807)::bigint,
       prev_count = CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END,
       expires_at = greatest(t.window_start, excluded.window_start) + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       allowed = (CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END)::numeric * (sqlc.arg(window_us)::bigint - least(greatest((extract(epoch FROM coalesce(sqlc.narg(at)::timestamptz, now())) * 1000000)::bigint - (extract(epoch FROM greatest(t.window_start, excluded.window_start)) * 1000000)::bigint, 0), sqlc.arg(window_us)::bigint))
                 + ((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric + sqlc.arg(cost)::bigint) * sqlc.arg(window_us)::bigint
                 <= sqlc.arg(max_count)::bigint::numeric * sqlc.arg(window_us)::bigint
RETURNING (extract(epoch FROM window_start) * 1000000)::bigint AS window_start_us, count, prev_count, allowed,
          (SELECT now_us FROM p)::bigint AS now_us;

-- name: SlidingWindowTakeMany :many
-- SlidingWindowTakeMany is SlidingWindowTake for several keys at once, under
-- the rules of FixedWindowTakeMany. The update arm reads the current
-- window's start from the proposed row's window_start and the cost from its
-- count, and spells the rolled-forward counts out where it needs them, as
-- TokenBucketTakeMany does.
WITH p AS (
    SELECT n.ts, n.now_us,
           timestamptz 'epoch' + (n.now_us - ((n.now_us % n.window_us) + n.window_us) % n.window_us) * interval '1 microsecond' AS window_start,
           n.window_us, n.max_count, n.penalty
      FROM (SELECT c.ts, (extract(epoch FROM c.ts) * 1000000)::bigint AS now_us,
                   c.window_us, c.max_count, c.penalty
              FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
                           sqlc.arg(window_us)::bigint AS window_us,
                           sqlc.arg(max_count)::bigint AS max_count,
                           sqlc.arg(penalty)::boolean AS penalty) AS c) AS n
)
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
SELECT (sqlc.arg(keys)::bytea[])[i],
       p.window_start,
       (sqlc.arg(costs)::bigint[])[i],
       0,
       p.window_start + 2 * p.window_us * interval '1 microsecond',
       (sqlc.arg(costs)::bigint[])[i] <= p.max_count
  FROM p, generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET window_start = greatest(t.window_start, excluded.window_start),
       count = least((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric
               + CASE WHEN (CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END)::numeric * (sqlc.arg(window_us)::bigint - least(greatest((extract(epoch FROM coalesce(sqlc.narg(at)::timestamptz, now())) * 1000000)::bigint - (extract(epoch FROM greatest(t.window_start, excluded.window_start)) * 1000000)::bigint, 0), sqlc.arg(window_us)::bigint))
                           + ((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric + excluded.count) * sqlc.arg(window_us)::bigint
                           <= sqlc.arg(max_count)::bigint::numeric * sqlc.arg(window_us)::bigint
                        OR sqlc.arg(penalty)::boolean
                      THEN excluded.count ELSE 0 END, 9223372036854775807)::bigint,
       prev_count = CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END,
       expires_at = greatest(t.window_start, excluded.window_start) + 2 * sqlc.arg(window_us)::bigint * interval '1 microsecond',
       allowed = (CASE WHEN t.window_start >= excluded.window_start THEN t.prev_count WHEN t.window_start = excluded.window_start - sqlc.arg(window_us)::bigint * interval '1 microsecond' THEN t.count ELSE 0 END)::numeric * (sqlc.arg(window_us)::bigint - least(greatest((extract(epoch FROM coalesce(sqlc.narg(at)::timestamptz, now())) * 1000000)::bigint - (extract(epoch FROM greatest(t.window_start, excluded.window_start)) * 1000000)::bigint, 0), sqlc.arg(window_us)::bigint))
                 + ((CASE WHEN t.window_start >= excluded.window_start THEN t.count ELSE 0 END)::numeric + excluded.count) * sqlc.arg(window_us)::bigint
                 <= sqlc.arg(max_count)::bigint::numeric * sqlc.arg(window_us)::bigint
RETURNING encode(key, 'hex') AS key_hex, (extract(epoch FROM window_start) * 1000000)::bigint AS window_start_us, count, prev_count, allowed,
          (SELECT now_us FROM p)::bigint AS now_us;

-- name: SlidingWindowPeek :one
-- SlidingWindowPeek reports the key's current and previous window counts as
-- of now, rolled forward as a check would, without counting anything.
WITH p AS (
    SELECT n.ts,
           timestamptz 'epoch' + (n.now_us - ((n.now_us % n.window_us) + n.window_us) % n.window_us) * interval '1 microsecond' AS window_start,
           n.now_us, n.window_us
      FROM (SELECT c.ts, (extract(epoch FROM c.ts) * 1000000)::bigint AS now_us, c.window_us
              FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
                           sqlc.arg(window_us)::bigint AS window_us) AS c) AS n
), r AS (
    SELECT t.window_start, t.count, t.prev_count
      FROM pgrl_sliding_window AS t
     WHERE t.key = sqlc.arg(key)::bytea
)
SELECT (extract(epoch FROM greatest(p.window_start, coalesce((SELECT r.window_start FROM r), p.window_start))) * 1000000)::bigint AS window_start_us,
       coalesce((SELECT CASE WHEN r.window_start >= p.window_start THEN r.count ELSE 0 END FROM r), 0)::bigint AS count,
       coalesce((SELECT CASE WHEN r.window_start >= p.window_start THEN r.prev_count
                             WHEN r.window_start = p.window_start - p.window_us * interval '1 microsecond' THEN r.count
                             ELSE 0 END FROM r), 0)::bigint AS prev_count,
       p.now_us::bigint AS now_us
  FROM p;

-- name: SlidingWindowReset :execrows
-- SlidingWindowReset forgets the key's counts.
DELETE FROM pgrl_sliding_window WHERE key = sqlc.arg(key)::bytea;
