-- name: FixedWindowTakeMany :many
-- FixedWindowTakeMany is FixedWindowTake for several keys at once: it
-- decides many checks of one limiter in one statement, one check per
-- distinct key, so that concurrent checks can share one round trip. Each row
-- gets exactly the arithmetic of the single check. Rows are inserted, and so
-- locked, in key order: concurrent batches never deadlock. Keys must be
-- distinct within one call (one statement cannot update a row twice) and
-- each cost at most max_count. Keys come back hex-encoded (key_hex), which
-- no session setting changes (bytea_output does change bytea's text form). The update arm reads each check's cost back
-- from the proposed row (excluded), since it cannot see the arrays. Windows,
-- overflow and the returned instants are as in FixedWindowTake.
WITH p AS (
    SELECT ts,
           now_us, now_us - ((now_us % window_us) + window_us) % window_us + window_us AS expires_us,
           max_count, penalty
      FROM (SELECT ts, (extract(epoch FROM ts) * 1000000)::bigint AS now_us, window_us, max_count, penalty
              FROM (SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
                           sqlc.arg(window_us)::bigint AS window_us,
                           sqlc.arg(max_count)::bigint AS max_count,
                           sqlc.arg(penalty)::boolean AS penalty) AS c) AS n
)
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed)
SELECT (sqlc.arg(keys)::bytea[])[i], timestamptz 'epoch' + p.expires_us * interval '1 microsecond',
       (sqlc.arg(costs)::bigint[])[i], (sqlc.arg(costs)::bigint[])[i] <= p.max_count
  FROM p, generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i
 ORDER BY 1
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = CASE WHEN t.count <= sqlc.arg(max_count)::bigint - excluded.count THEN t.count + excluded.count
                    WHEN NOT sqlc.arg(penalty)::boolean THEN t.count
                    WHEN t.count <= 9223372036854775807 - excluded.count THEN t.count + excluded.count
                    ELSE 9223372036854775807 END,
       allowed = t.count <= sqlc.arg(max_count)::bigint - excluded.count
RETURNING encode(key, 'hex') AS key_hex, count, (SELECT expires_us FROM p)::bigint AS expires_at_us, allowed, (SELECT now_us FROM p)::bigint AS now_us;

-- name: TokenBucketTakeMany :many
-- TokenBucketTakeMany is TokenBucketTake for several keys at once, under the
-- rules of FixedWindowTakeMany. The update arm reads the check's instant
-- from the proposed row's updated_at and its cost as capacity minus the
-- proposed balance (exact for integer costs). It spells the refilled
-- balance out where it needs it, rather than in a subquery, because a
-- subquery there runs once per row and costs more than the arithmetic.
-- The balance and instants are returned as in TokenBucketTake.
WITH p AS (
    SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
           sqlc.arg(capacity)::float8 AS capacity,
           sqlc.arg(refill_per_us)::float8 AS refill_per_us
)
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
SELECT (sqlc.arg(keys)::bytea[])[i],
       p.capacity - (sqlc.arg(costs)::float8[])[i],
       p.ts,
       p.ts + ((sqlc.arg(costs)::float8[])[i] / p.refill_per_us) * interval '1 microsecond',
       (sqlc.arg(costs)::float8[])[i] <= p.capacity
  FROM p, generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET tokens = greatest(least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8)
                         - CASE WHEN least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= (sqlc.arg(capacity)::float8 - excluded.tokens) OR sqlc.arg(penalty)::boolean THEN (sqlc.arg(capacity)::float8 - excluded.tokens) ELSE 0 END,
                         0 - sqlc.arg(capacity)::float8),
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(t.updated_at, excluded.updated_at)
                 + ((sqlc.arg(capacity)::float8 - greatest(least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8)
                                - CASE WHEN least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= (sqlc.arg(capacity)::float8 - excluded.tokens) OR sqlc.arg(penalty)::boolean THEN (sqlc.arg(capacity)::float8 - excluded.tokens) ELSE 0 END,
                                0 - sqlc.arg(capacity)::float8)) / sqlc.arg(refill_per_us)::float8) * interval '1 microsecond',
       allowed = least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= (sqlc.arg(capacity)::float8 - excluded.tokens)
RETURNING encode(key, 'hex') AS key_hex,
          ('x' || encode(float8send(tokens), 'hex'))::bit(64)::bigint AS tokens_bits,
          (extract(epoch FROM updated_at) * 1000000)::bigint AS updated_at_us,
          (extract(epoch FROM full_at) * 1000000)::bigint AS full_at_us,
          allowed;

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
