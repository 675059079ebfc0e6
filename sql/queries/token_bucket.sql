-- name: TokenBucketTake :one
-- TokenBucketTake refills the key's bucket for the time since its last
-- check, then spends cost tokens if the balance covers them, in one statement:
-- a first check inserts a full bucket minus cost, every later one is the
-- UPDATE arm of the same upsert. The balance never exceeds capacity. A denied
-- check spends nothing, unless penalty is set: then it is charged anyway and
-- the balance may fall as low as -capacity, never lower. The UPDATE arm
-- spells the refilled balance out where it needs it: a subquery there would
-- be set up and run for every row, which costs more than the arithmetic.
-- refill_per_us is tokens per microsecond. The balance is returned as the
-- bits of its float8 (tokens_bits; math.Float64frombits in Go) and instants
-- as microseconds since the Unix epoch: exact, and shaped by no session
-- setting (extra_float_digits, DateStyle, TimeZone).
-- Elapsed time is clamped at zero, so a check that waited on the row lock and
-- sees a newer updated_at than its own clock never refills backwards. at pins
-- the clock for tests; production leaves it nil.
WITH p AS (
    SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
           sqlc.arg(cost)::float8 AS cost,
           sqlc.arg(capacity)::float8 AS capacity,
           sqlc.arg(refill_per_us)::float8 AS refill_per_us,
           sqlc.arg(penalty)::boolean AS penalty
)
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
SELECT sqlc.arg(key)::bytea,
       f.tokens,
       p.ts,
       p.ts + ((p.capacity - f.tokens) / p.refill_per_us) * interval '1 microsecond',
       f.allowed
  FROM p,
       LATERAL (
           SELECT CASE WHEN p.cost <= p.capacity OR p.penalty THEN p.capacity - p.cost
                       ELSE p.capacity END AS tokens,
                  p.cost <= p.capacity AS allowed
       ) AS f
ON CONFLICT (key) DO UPDATE
   SET tokens = greatest(least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8)
                         - CASE WHEN least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= sqlc.arg(cost)::float8 OR sqlc.arg(penalty)::boolean THEN sqlc.arg(cost)::float8 ELSE 0 END,
                         0 - sqlc.arg(capacity)::float8),
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(t.updated_at, excluded.updated_at)
                 + ((sqlc.arg(capacity)::float8 - greatest(least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8)
                                - CASE WHEN least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= sqlc.arg(cost)::float8 OR sqlc.arg(penalty)::boolean THEN sqlc.arg(cost)::float8 ELSE 0 END,
                                0 - sqlc.arg(capacity)::float8)) / sqlc.arg(refill_per_us)::float8) * interval '1 microsecond',
       allowed = least(sqlc.arg(capacity)::float8, t.tokens + greatest((extract(epoch FROM excluded.updated_at - t.updated_at) * 1000000)::bigint, 0)::float8 * sqlc.arg(refill_per_us)::float8) >= sqlc.arg(cost)::float8
RETURNING ('x' || encode(float8send(tokens), 'hex'))::bit(64)::bigint AS tokens_bits,
          (extract(epoch FROM updated_at) * 1000000)::bigint AS updated_at_us,
          (extract(epoch FROM full_at) * 1000000)::bigint AS full_at_us,
          allowed;

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

-- name: TokenBucketPeek :one
-- TokenBucketPeek reports the key's balance now, refilled, without spending.
-- A key never seen has a full bucket. Returned as TokenBucketTake returns
-- them: the balance's float8 bits and the instant in microseconds.
WITH p AS (
    SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
           sqlc.arg(capacity)::float8 AS capacity,
           sqlc.arg(refill_per_us)::float8 AS refill_per_us
)
SELECT ('x' || encode(float8send(coalesce(
           (SELECT least(p.capacity,
                         t.tokens + greatest((extract(epoch FROM p.ts - t.updated_at) * 1000000)::bigint, 0)::float8
                                    * p.refill_per_us)
              FROM pgrl_token_bucket AS t
             WHERE t.key = sqlc.arg(key)::bytea),
           p.capacity)::float8), 'hex'))::bit(64)::bigint AS tokens_bits,
       (extract(epoch FROM p.ts) * 1000000)::bigint AS now_us
  FROM p;

-- name: TokenBucketReset :execrows
-- TokenBucketReset forgets the key's bucket: its next check finds it full.
DELETE FROM pgrl_token_bucket WHERE key = sqlc.arg(key)::bytea;
