
-- name: TokenBucketTake :one
-- TokenBucketTake refills the key's bucket for the time since its last
-- check, then spends cost tokens if the balance covers them, in one statement:
-- a first check inserts a full bucket less what the check spends, every later
-- one is the UPDATE arm of the same upsert. The token bucket's step
-- (pgrl_token_bucket_take, migrations 000012 and 000022) decides: the balance
-- never exceeds capacity less the units out on lease (migration 000016); a
-- denied check spends nothing, unless penalty is set: then it is charged
-- anyway and the balance may fall as low as -capacity, never lower.
-- refill_per_us is tokens per microsecond. The balance is returned as the
-- bits of its float8 (tokens_bits; math.Float64frombits in Go) and instants
-- as microseconds since the Unix epoch: exact, and shaped by no session
-- setting (extra_float_digits, DateStyle, TimeZone). The update arm reads
-- the check's instant from the proposed row (excluded.updated_at), and its
-- lease epoch (excluded.lease_epoch_us), and calls only IMMUTABLE functions,
-- as a distributed PostgreSQL (Citus) requires. It gives the step the time
-- since the row's last check as its two instants (0 and pgrl_elapsed_us,
-- clamped at zero, so a check that waited on the row lock and sees a newer
-- updated_at than its own clock never refills backwards): one conversion
-- where two instants would take two in every place the step uses them. The
-- insert arm's full bucket is the step's at instants 0 and now (a full
-- bucket stays full); it is given the instant only so that the planner
-- never runs the step at plan time, which it does with an IMMUTABLE
-- function of constants. full_at is not before the row's leases are over.
-- at pins the clock for tests; production leaves it nil.
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed, lease_epoch_us)
VALUES (sqlc.arg(key)::bytea,
        (pgrl_token_bucket_take(sqlc.arg(capacity)::float8, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                sqlc.arg(cost)::bigint,
                                sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8,
                                sqlc.arg(penalty)::boolean, false)).tokens,
        pgrl_now(sqlc.narg(at)::timestamptz),
        pgrl_token_bucket_full_at(
            pgrl_now(sqlc.narg(at)::timestamptz),
            (pgrl_token_bucket_take(sqlc.arg(capacity)::float8, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                sqlc.arg(cost)::bigint,
                                    sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8,
                                    sqlc.arg(penalty)::boolean, false)).tokens,
            sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8),
        (pgrl_token_bucket_take(sqlc.arg(capacity)::float8, 0, pgrl_now_us(sqlc.narg(at)::timestamptz),
                                sqlc.arg(cost)::bigint,
                                sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8,
                                sqlc.arg(penalty)::boolean, false)).allowed,
        pgrl_token_bucket_lease_epoch_us(pgrl_now_us(sqlc.narg(at)::timestamptz)))
ON CONFLICT (key) DO UPDATE
   SET tokens = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                        sqlc.arg(cost)::bigint,
                                        sqlc.arg(capacity)::float8
                                        - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                   excluded.lease_epoch_us),
                                        sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean, false)).tokens,
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(pgrl_token_bucket_refilled_at(
                              greatest(t.updated_at, excluded.updated_at),
                              (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                                      sqlc.arg(cost)::bigint,
                                                      sqlc.arg(capacity)::float8
                                                      - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased,
                                                                                 t.leased_prev,
                                                                                 excluded.lease_epoch_us),
                                                      sqlc.arg(refill_per_us)::float8,
                                                      sqlc.arg(penalty)::boolean, false)).tokens,
                              sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8),
                          pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev)),
       allowed = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                         sqlc.arg(cost)::bigint,
                                         sqlc.arg(capacity)::float8
                                         - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                    excluded.lease_epoch_us),
                                         sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean,
                                         false)).allowed
RETURNING pgrl_float8_bits(tokens) AS tokens_bits,
          pgrl_us(updated_at) AS updated_at_us,
          pgrl_us(full_at) AS full_at_us,
          allowed;

-- name: TokenBucketPeek :one
-- TokenBucketPeek reports the key's balance now, refilled (up to capacity
-- less the units out on lease), without spending. A key never seen has a
-- full bucket. Returned as TokenBucketTake returns them: the balance's
-- float8 bits and the instant in microseconds.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts) AS c
)
SELECT pgrl_float8_bits(coalesce(
           (SELECT pgrl_token_bucket_refill(t.tokens, pgrl_elapsed_us(t.updated_at, clock.ts),
                                            sqlc.arg(capacity)::float8
                                            - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                       clock.now_us),
                                            sqlc.arg(refill_per_us)::float8)
              FROM pgrl_token_bucket AS t
             WHERE t.key = sqlc.arg(key)::bytea),
           sqlc.arg(capacity)::float8)::float8) AS tokens_bits,
       clock.now_us::bigint AS now_us
  FROM clock;

-- name: TokenBucketReset :execrows
-- TokenBucketReset forgets the key's bucket: its next check finds it full.
DELETE FROM pgrl_token_bucket WHERE key = sqlc.arg(key)::bytea;

-- name: TokenBucketTakeUpTo :one
-- TokenBucketTakeUpTo is a partial grant: it spends as many of n tokens as
-- the refilled bucket holds whole (possibly none, which is a denial) and
-- returns that number as granted. n is a ceiling, not a cost: an n above
-- capacity is taken as capacity (migration 000010). Under penalty the ask
-- (n, at most capacity) is charged, the balance stopping at -capacity. The
-- units out on lease count against the capacity (migration 000016).
SELECT q.granted::bigint AS granted, q.tokens_bits::bigint AS tokens_bits, q.updated_at_us::bigint AS updated_at_us,
       q.full_at_us::bigint AS full_at_us, q.allowed::boolean AS allowed
  FROM pgrl_token_bucket_take_queue(ARRAY[sqlc.arg(key)::bytea], ARRAY[sqlc.arg(n)::bigint], ARRAY[true],
                                    ARRAY[1], ARRAY[sqlc.arg(capacity)::float8],
                                    ARRAY[sqlc.arg(refill_per_us)::float8], ARRAY[sqlc.arg(penalty)::boolean],
                                    sqlc.narg(at)::timestamptz) AS q;
