-- name: TokenBucketTake :one
-- TokenBucketTake refills the key's bucket for the time since its last
-- check, then spends cost tokens if the balance covers them, in one statement:
-- a first check inserts a full bucket minus cost, every later one is the
-- UPDATE arm of the same upsert. The balance never exceeds capacity. A denied
-- check spends nothing, unless penalty is set: then it is charged anyway and
-- the balance may fall to -capacity. refill_per_us is tokens per microsecond.
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
   SET (tokens, updated_at, full_at, allowed) = (
       SELECT s.tokens,
              s.at,
              s.at + ((s.capacity - s.tokens) / s.refill_per_us) * interval '1 microsecond',
              s.allowed
         FROM (
             SELECT CASE WHEN a.avail >= a.cost THEN a.avail - a.cost
                         WHEN a.penalty THEN greatest(a.avail - a.cost, 0 - a.capacity)
                         ELSE a.avail END AS tokens,
                    a.avail >= a.cost AS allowed,
                    a.at, a.capacity, a.refill_per_us
               FROM (
                   SELECT least(p.capacity,
                                t.tokens + greatest((extract(epoch FROM p.ts - t.updated_at) * 1000000)::bigint, 0)::float8
                                           * p.refill_per_us) AS avail,
                          greatest(t.updated_at, p.ts) AS at,
                          p.cost, p.capacity, p.refill_per_us, p.penalty
                     FROM p
               ) AS a
         ) AS s
   )
RETURNING tokens, updated_at, full_at, allowed;

-- name: TokenBucketPeek :one
-- TokenBucketPeek reports the key's balance now, refilled, without spending.
-- A key never seen has a full bucket.
WITH p AS (
    SELECT coalesce(sqlc.narg(at)::timestamptz, now()) AS ts,
           sqlc.arg(capacity)::float8 AS capacity,
           sqlc.arg(refill_per_us)::float8 AS refill_per_us
)
SELECT coalesce(
           (SELECT least(p.capacity,
                         t.tokens + greatest((extract(epoch FROM p.ts - t.updated_at) * 1000000)::bigint, 0)::float8
                                    * p.refill_per_us)
              FROM pgrl_token_bucket AS t
             WHERE t.key = sqlc.arg(key)::bytea),
           p.capacity)::float8 AS tokens,
       p.ts::timestamptz AS now
  FROM p;

-- name: TokenBucketReset :execrows
-- TokenBucketReset forgets the key's bucket: its next check finds it full.
DELETE FROM pgrl_token_bucket WHERE key = sqlc.arg(key)::bytea;
