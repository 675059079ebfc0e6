-- The sliding window statements the library sends that are not part of
-- package gen: the set-based batch of single checks (coalesced checks of
-- distinct keys) and the take that reads its stored policy in the statement.

-- name: SlidingWindowTakeMany :many
-- SlidingWindowTakeMany is SlidingWindowTake for several keys at once, under
-- the rules of FixedWindowTakeMany: the update arm reads each check's
-- charge back from the proposed row's count, and a check the proposed row
-- denies stays denied. Its figures sit in an
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
   SET window_start = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        excluded.count, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us),
       count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        excluded.count, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).count,
       prev_count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        excluded.count, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        excluded.count, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = excluded.allowed
                 AND (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        excluded.count, sqlc.arg(max_count)::bigint,
                                        sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING encode(key, 'hex') AS key_hex, pgrl_us(window_start) AS window_start_us, count, prev_count,
          allowed, pgrl_us(updated_at) AS now_us;

-- name: SlidingWindowTakePolicy :one
-- SlidingWindowTakePolicy is SlidingWindowTake with the limit stored in the
-- database, read in this same statement under the rules of
-- FixedWindowTakePolicy: no row comes back, and nothing is counted, when
-- the policy (with the key's override) no longer has window_us, is no
-- longer a sliding window, no longer stores keys in key_mode, or does not
-- exist. max_count is the limit that was applied. As there, the update arm
-- reads the figures from the proposed row, and OFFSET 0 computes them once.
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
               = sqlc.arg(window_us)::bigint
        OFFSET 0) AS f
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us),
       count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).count,
       prev_count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us
                                    + 2 * sqlc.arg(window_us)::bigint),
       allowed = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        sqlc.arg(window_us)::bigint,
                                        sqlc.arg(cost)::bigint, excluded.policy_limit,
                                        excluded.policy_penalty, false)).allowed,
       updated_at = excluded.updated_at,
       policy_limit = excluded.policy_limit,
       policy_penalty = excluded.policy_penalty
RETURNING pgrl_us(window_start) AS window_start_us, count, prev_count, allowed,
          pgrl_us(updated_at) AS now_us,
          policy_limit::bigint AS max_count;

-- name: SlidingWindowTakeManyPolicy :many
-- SlidingWindowTakeManyPolicy is SlidingWindowTakeMany with the limit
-- stored in the database, read for each key under the rules of
-- FixedWindowTakeManyPolicy: a key whose policy no longer matches is not
-- counted and does not come back. max_count is the limit that was applied.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at,
                                      policy_limit, policy_penalty)
SELECT (@keys::bytea[])[f.i] AS key, pgrl_from_epoch_us(p.start_us) AS window_start, s.count,
       0::bigint AS prev_count, pgrl_from_epoch_us(p.start_us + 2 * p.window_us) AS expires_at, s.allowed,
       p.ts AS updated_at, f.max_count, f.penalty
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us,
               pgrl_window_start_us(pgrl_now_us(sqlc.narg(at)::timestamptz), @window_us::bigint) AS start_us,
               @window_us::bigint AS window_us
        OFFSET 0) AS p,
       LATERAL (SELECT i, coalesce(o."limit", pol."limit") AS max_count, pol.penalty
                  FROM generate_subscripts(@keys::bytea[], 1) AS i
                  JOIN pgrl_policy AS pol
                    ON pol.name = @policy::text AND pol.algorithm = 'sliding_window'
                   AND pol.key_mode = @key_mode::text
                  LEFT JOIN LATERAL (
                        -- One index probe per key (LIMIT 1: the key is the primary
                        -- key's), not a join of the policy's every override.
                        SELECT o."limit", o."window" FROM pgrl_policy_override AS o
                         WHERE o.policy = pol.name AND o.key = (@override_keys::bytea[])[i]
                           AND (o.expires_at IS NULL OR o.expires_at > p.ts)
                         LIMIT 1) AS o ON true
                 WHERE round(date_part('epoch', coalesce(o."window", pol."window")) * 1000000)::bigint
                       = @window_us::bigint) AS f,
       LATERAL pgrl_sliding_window_take(NULL, 0, 0, p.now_us, p.window_us, (@costs::bigint[])[f.i],
                                        f.max_count, f.penalty, false) AS s
 ORDER BY 1
ON CONFLICT (key) DO UPDATE
   SET window_start = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        @window_us::bigint,
                                        excluded.count, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us),
       count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        @window_us::bigint,
                                        excluded.count, excluded.policy_limit,
                                        excluded.policy_penalty, false)).count,
       prev_count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        @window_us::bigint,
                                        excluded.count, excluded.policy_limit,
                                        excluded.policy_penalty, false)).prev_count,
       expires_at = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        @window_us::bigint,
                                        excluded.count, excluded.policy_limit,
                                        excluded.policy_penalty, false)).window_start_us
                                    + 2 * @window_us::bigint),
       allowed = excluded.allowed
                 AND (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                        pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                        @window_us::bigint,
                                        excluded.count, excluded.policy_limit,
                                        excluded.policy_penalty, false)).allowed,
       updated_at = excluded.updated_at,
       policy_limit = excluded.policy_limit,
       policy_penalty = excluded.policy_penalty
RETURNING encode(key, 'hex') AS key_hex, pgrl_us(window_start) AS window_start_us, count, prev_count,
          allowed, pgrl_us(updated_at) AS now_us, policy_limit::bigint AS max_count;

-- name: SlidingWindowTakeUnderPolicy :one
-- SlidingWindowTakeUnderPolicy is SlidingWindowTake with the figures the
-- caller holds for the stored policy named policy (max_count, window_us,
-- penalty), counted only while that policy's row still holds them, for a
-- sliding window storing keys in key_mode, and has no override or still
-- has overrides_revision, as FixedWindowTakeUnderPolicy does:
-- otherwise nothing is counted and no row comes back, and the caller sends
-- SlidingWindowTakePolicy. The counter row's policy_limit and policy_penalty
-- are left as they are.
INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at)
SELECT sqlc.arg(key)::bytea,
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
       pgrl_now(sqlc.narg(at)::timestamptz)
  FROM pgrl_policy AS p
 WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'sliding_window' AND p.key_mode = sqlc.arg(key_mode)::text
   AND (NOT p.has_overrides OR p.overrides_revision = sqlc.arg(overrides_revision)::bigint)
   AND p."limit" = sqlc.arg(max_count)::bigint AND p.penalty = sqlc.arg(penalty)::boolean
   AND round(date_part('epoch', p."window") * 1000000)::bigint = sqlc.arg(window_us)::bigint
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
