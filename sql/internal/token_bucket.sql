-- The token bucket statements the library sends that are not part of
-- package gen: the set-based batch of single checks (coalesced checks of
-- distinct keys), the take that reads its stored policy in the statement,
-- and the return of a lease's unused units (migration 000016).

-- name: TokenBucketTakeMany :many
-- TokenBucketTakeMany is TokenBucketTake for several keys at once, under the
-- rules of FixedWindowTakeMany. The update arm reads the check's instant from
-- the proposed row's updated_at and its charge as capacity less the proposed
-- balance (exact for integer costs below 2^53): the cost, or, for a cost
-- alone over the capacity, nothing (without penalty; the check stays denied,
-- as the proposed row's allowed is ANDed in) or at most twice the capacity
-- (under penalty, which floors the balance at -capacity whatever the cost).
-- The balance and instants are returned as in TokenBucketTake, and the units
-- out on lease count as they do there (the proposed row carries the check's
-- lease epoch). Its figures sit in an unflattened one-row subquery, as
-- FixedWindowTakeMany's do.
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed, lease_epoch_us)
SELECT (sqlc.arg(keys)::bytea[])[i] AS key, s.tokens, p.ts AS updated_at,
       pgrl_token_bucket_full_at(p.ts, s.tokens, p.capacity, p.refill_per_us) AS full_at, s.allowed,
       pgrl_token_bucket_lease_epoch_us(p.now_us) AS lease_epoch_us
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us,
               sqlc.arg(capacity)::float8 AS capacity, sqlc.arg(refill_per_us)::float8 AS refill_per_us,
               sqlc.arg(penalty)::boolean AS penalty
        OFFSET 0) AS p,
       generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i,
       LATERAL pgrl_token_bucket_take(p.capacity, p.now_us, p.now_us, (sqlc.arg(costs)::bigint[])[i], p.capacity,
                                      p.refill_per_us, p.penalty, false) AS s
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET tokens = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                        (sqlc.arg(capacity)::float8 - excluded.tokens)::bigint,
                                        sqlc.arg(capacity)::float8
                                        - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                   excluded.lease_epoch_us),
                                        sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean, false)).tokens,
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(pgrl_token_bucket_refilled_at(
                              greatest(t.updated_at, excluded.updated_at),
                              (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                                      (sqlc.arg(capacity)::float8 - excluded.tokens)::bigint,
                                                      sqlc.arg(capacity)::float8
                                                      - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased,
                                                                                 t.leased_prev,
                                                                                 excluded.lease_epoch_us),
                                                      sqlc.arg(refill_per_us)::float8,
                                                      sqlc.arg(penalty)::boolean, false)).tokens,
                              sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8),
                          pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev)),
       allowed = excluded.allowed
                 AND (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                             (sqlc.arg(capacity)::float8 - excluded.tokens)::bigint,
                                             sqlc.arg(capacity)::float8
                                             - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                        excluded.lease_epoch_us),
                                             sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean,
                                             false)).allowed
RETURNING encode(key, 'hex') AS key_hex,
          pgrl_float8_bits(tokens) AS tokens_bits,
          pgrl_us(updated_at) AS updated_at_us,
          pgrl_us(full_at) AS full_at_us,
          allowed;

-- name: TokenBucketTakePolicy :one
-- TokenBucketTakePolicy is TokenBucketTake with the rate stored in the
-- database: the limit, window, burst and penalty are read, in this same
-- statement, from the pgrl_policy row named policy and the key's
-- pgrl_policy_override (override_key is the key stored under the policy's
-- own name; an override applies until its expires_at), so that a changed
-- policy is obeyed by the very next check of every process. A key has one
-- bucket whatever its rate, so the window may change too. An override whose
-- rate the library would refuse under the policy as it is now (a burst
-- beyond 2^53 tokens, or more than 1,000 years to refill) is ignored, as
-- package policy ignores it. When the policy is no longer a token bucket,
-- no longer stores keys in key_mode ('hashed' or 'readable'), or does not
-- exist, nothing is counted and no row comes back: reload the policy and
-- check again. limit, window_us and burst are the rate that was applied.
-- The rate read in the insert arm reaches the update arm in the proposed
-- row (excluded.policy_limit and the rest; migration 000013): capacity is
-- the burst and refill_per_us is limit / window_us, as the library has them.
-- The units out on lease count as they do in TokenBucketTake. As in
-- FixedWindowTakePolicy, OFFSET 0 computes the rate once.
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed,
                                    policy_limit, policy_window_us, policy_burst, policy_penalty, lease_epoch_us)
SELECT sqlc.arg(key)::bytea,
       (pgrl_token_bucket_take(f.capacity, f.now_us, f.now_us, sqlc.arg(cost)::bigint, f.capacity,
                               f.refill_per_us, f.penalty, false)).tokens,
       f.ts,
       pgrl_token_bucket_full_at(
           f.ts,
           (pgrl_token_bucket_take(f.capacity, f.now_us, f.now_us, sqlc.arg(cost)::bigint, f.capacity,
                                   f.refill_per_us, f.penalty, false)).tokens,
           f.capacity, f.refill_per_us),
       (pgrl_token_bucket_take(f.capacity, f.now_us, f.now_us, sqlc.arg(cost)::bigint, f.capacity,
                               f.refill_per_us, f.penalty, false)).allowed,
       f."limit", f.window_us, f.burst, f.penalty, pgrl_token_bucket_lease_epoch_us(f.now_us)
  FROM (SELECT r.*, r.burst::float8 AS capacity, r."limit"::float8 / r.window_us::float8 AS refill_per_us
          FROM (SELECT coalesce(o."limit", p."limit") AS "limit",
               round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint AS window_us,
               coalesce(o.burst, p.burst, o."limit", p."limit") AS burst,
               p.penalty,
               pgrl_now(sqlc.narg(at)::timestamptz) AS ts,
               pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us
          FROM pgrl_policy AS p
          LEFT JOIN pgrl_policy_override AS o
            ON o.policy = p.name AND o.key = sqlc.arg(override_key)::bytea
           AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
           AND coalesce(o.burst, p.burst, o."limit", p."limit") <= 9007199254740992
           AND coalesce(o.burst, p.burst, o."limit", p."limit")::numeric
               * round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::numeric
               <= coalesce(o."limit", p."limit")::numeric * 31557600000000000
         WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'token_bucket'
           AND p.key_mode = sqlc.arg(key_mode)::text) AS r
        OFFSET 0) AS f
ON CONFLICT (key) DO UPDATE
   SET tokens = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                        sqlc.arg(cost)::bigint,
                                        (excluded.policy_burst
                                         - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                    excluded.lease_epoch_us))::float8,
                                        excluded.policy_limit::float8 / excluded.policy_window_us::float8,
                                        excluded.policy_penalty, false)).tokens,
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(pgrl_token_bucket_refilled_at(
                              greatest(t.updated_at, excluded.updated_at),
                              (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                                      sqlc.arg(cost)::bigint,
                                                      (excluded.policy_burst
                                                       - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased,
                                                                                  t.leased_prev,
                                                                                  excluded.lease_epoch_us))::float8,
                                                      excluded.policy_limit::float8
                                                      / excluded.policy_window_us::float8,
                                                      excluded.policy_penalty, false)).tokens,
                              excluded.policy_burst::float8,
                              excluded.policy_limit::float8 / excluded.policy_window_us::float8),
                          pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev)),
       allowed = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                         sqlc.arg(cost)::bigint,
                                         (excluded.policy_burst
                                          - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                     excluded.lease_epoch_us))::float8,
                                         excluded.policy_limit::float8 / excluded.policy_window_us::float8,
                                         excluded.policy_penalty, false)).allowed,
       policy_limit = excluded.policy_limit,
       policy_window_us = excluded.policy_window_us,
       policy_burst = excluded.policy_burst,
       policy_penalty = excluded.policy_penalty
RETURNING pgrl_float8_bits(tokens) AS tokens_bits,
          pgrl_us(updated_at) AS updated_at_us,
          pgrl_us(full_at) AS full_at_us,
          allowed,
          policy_limit::bigint AS "limit",
          policy_window_us::bigint AS window_us,
          policy_burst::bigint AS burst;

-- name: TokenBucketTakeManyPolicy :many
-- TokenBucketTakeManyPolicy is TokenBucketTakeMany with the rate stored in
-- the database, read for each key under the rules of TokenBucketTakePolicy
-- (policy's row, and the key's override, override_keys[i], while it lasts
-- and while the policy admits it). A key whose policy is missing, or no
-- longer a token bucket storing keys in key_mode, is not counted and does
-- not come back: the caller decides it on its own. The rate read for each
-- key reaches the update arm in the proposed row (excluded.policy_limit and
-- the rest), which reads the check's charge back as TokenBucketTakeMany's
-- does, against the burst read. limit, window_us and burst are the rate
-- that was applied.
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed, lease_epoch_us,
                                    policy_limit, policy_window_us, policy_burst, policy_penalty)
SELECT (@keys::bytea[])[f.i] AS key, s.tokens, p.ts AS updated_at,
       pgrl_token_bucket_full_at(p.ts, s.tokens, f.burst::float8, f."limit"::float8 / f.window_us::float8) AS full_at,
       s.allowed, pgrl_token_bucket_lease_epoch_us(p.now_us) AS lease_epoch_us,
       f."limit", f.window_us, f.burst, f.penalty
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us
        OFFSET 0) AS p,
       LATERAL (SELECT i, coalesce(o."limit", pol."limit") AS "limit",
                       round(date_part('epoch', coalesce(o."window", pol."window")) * 1000000)::bigint AS window_us,
                       coalesce(o.burst, pol.burst, o."limit", pol."limit") AS burst, pol.penalty
                  FROM generate_subscripts(@keys::bytea[], 1) AS i
                  JOIN pgrl_policy AS pol
                    ON pol.name = @policy::text AND pol.algorithm = 'token_bucket' AND pol.key_mode = @key_mode::text
                  LEFT JOIN LATERAL (
                        -- One index probe per key (LIMIT 1: the key is the primary
                        -- key's), not a join of the policy's every override.
                        SELECT o."limit", o."window", o.burst FROM pgrl_policy_override AS o
                         WHERE o.policy = pol.name AND o.key = (@override_keys::bytea[])[i]
                           AND (o.expires_at IS NULL OR o.expires_at > p.ts)
                         LIMIT 1) AS o
                    ON true
                   AND coalesce(o.burst, pol.burst, o."limit", pol."limit") <= 9007199254740992
                   AND coalesce(o.burst, pol.burst, o."limit", pol."limit")::numeric
                       * round(date_part('epoch', coalesce(o."window", pol."window")) * 1000000)::numeric
                       <= coalesce(o."limit", pol."limit")::numeric * 31557600000000000) AS f,
       LATERAL pgrl_token_bucket_take(f.burst::float8, p.now_us, p.now_us, (@costs::bigint[])[f.i], f.burst::float8,
                                      f."limit"::float8 / f.window_us::float8, f.penalty, false) AS s
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET tokens = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                        (excluded.policy_burst::float8 - excluded.tokens)::bigint,
                                        (excluded.policy_burst
                                         - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                    excluded.lease_epoch_us))::float8,
                                        excluded.policy_limit::float8 / excluded.policy_window_us::float8,
                                        excluded.policy_penalty, false)).tokens,
       updated_at = greatest(t.updated_at, excluded.updated_at),
       full_at = greatest(pgrl_token_bucket_refilled_at(
                              greatest(t.updated_at, excluded.updated_at),
                              (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                                      (excluded.policy_burst::float8 - excluded.tokens)::bigint,
                                                      (excluded.policy_burst
                                                       - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased,
                                                                                  t.leased_prev,
                                                                                  excluded.lease_epoch_us))::float8,
                                                      excluded.policy_limit::float8
                                                      / excluded.policy_window_us::float8,
                                                      excluded.policy_penalty, false)).tokens,
                              excluded.policy_burst::float8,
                              excluded.policy_limit::float8 / excluded.policy_window_us::float8),
                          pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev)),
       allowed = excluded.allowed
                 AND (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                             (excluded.policy_burst::float8 - excluded.tokens)::bigint,
                                             (excluded.policy_burst
                                              - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                         excluded.lease_epoch_us))::float8,
                                             excluded.policy_limit::float8 / excluded.policy_window_us::float8,
                                             excluded.policy_penalty, false)).allowed,
       policy_limit = excluded.policy_limit,
       policy_window_us = excluded.policy_window_us,
       policy_burst = excluded.policy_burst,
       policy_penalty = excluded.policy_penalty
RETURNING encode(key, 'hex') AS key_hex,
          pgrl_float8_bits(tokens) AS tokens_bits,
          pgrl_us(updated_at) AS updated_at_us,
          pgrl_us(full_at) AS full_at_us,
          allowed,
          policy_limit::bigint AS "limit",
          policy_window_us::bigint AS window_us,
          policy_burst::bigint AS burst;

-- name: TokenBucketReturnSlice :one
-- TokenBucketReturnSlice gives back n unused units of a slice taken at at
-- (the lease's instant: its slice's decision's Now, the updated_at_us
-- TokenBucketTakeChecks returned for it): they stop counting against
-- the capacity and are tokens again, the bucket refilled to the real
-- instant (now pins it for tests; production leaves it nil). It returns how
-- many units it gave back: 0 for a key without a row, and once the lease is
-- over (the bucket has refilled past its units) or the row's lease counts
-- have moved two epochs on; at most what the count of at's epoch holds.
SELECT pgrl_token_bucket_return_slice(sqlc.arg(key)::bytea, sqlc.arg(at)::timestamptz, sqlc.arg(n)::bigint,
                                      sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8,
                                      sqlc.narg(now)::timestamptz)::bigint AS returned;

-- name: TokenBucketTakeUnderPolicy :one
-- TokenBucketTakeUnderPolicy is TokenBucketTake with the rate the caller
-- holds for the stored policy named policy (rate_limit, window_us, burst,
-- penalty; capacity and refill_per_us are burst and limit / window_us, as
-- the library computes them from rate_limit), counted only while that policy's row still
-- holds that rate, for a token bucket storing keys in key_mode, and has no
-- override or still has overrides_revision, as FixedWindowTakeUnderPolicy
-- does: otherwise nothing is counted and no row comes back, and the caller
-- sends TokenBucketTakePolicy. The counter row's policy_* columns are left
-- as they are.
INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed, lease_epoch_us)
SELECT sqlc.arg(key)::bytea,
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
       pgrl_token_bucket_lease_epoch_us(pgrl_now_us(sqlc.narg(at)::timestamptz))
  FROM pgrl_policy AS p
 WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'token_bucket' AND p.key_mode = sqlc.arg(key_mode)::text
   AND (NOT p.has_overrides OR p.overrides_revision = sqlc.arg(overrides_revision)::bigint)
   AND p."limit" = sqlc.arg(rate_limit)::bigint
   AND coalesce(p.burst, p."limit") = sqlc.arg(burst)::bigint
   AND round(date_part('epoch', p."window") * 1000000)::bigint = sqlc.arg(window_us)::bigint
   AND p.penalty = sqlc.arg(penalty)::boolean
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
