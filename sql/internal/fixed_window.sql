-- The fixed window statements the library sends that are not part of
-- package gen: the set-based batch of single checks (coalesced checks of
-- distinct keys) and the take that reads its stored policy in the statement.

-- name: FixedWindowTakeMany :many
-- FixedWindowTakeMany is FixedWindowTake for several keys at once: it
-- decides many checks of one limiter in one statement, one check per
-- distinct key, so that concurrent checks can share one round trip. Each row
-- gets exactly the step of the single check. Rows are inserted, and so
-- locked, in key order: concurrent batches never deadlock. Keys must be
-- distinct within one call (one statement cannot update a row twice). Keys
-- come back hex-encoded (key_hex), which no session setting changes
-- (bytea_output does change bytea's text form). The update arm cannot see
-- the arrays, so it reads each check's charge back from the proposed row:
-- its count, which is the cost itself, except when the cost alone is over
-- max_count. Then the proposed row is denied: without penalty it charged
-- nothing, and a charge of nothing leaves the counter row as a denial does,
-- so the update arm's step is given that charge and its allowed is ANDed
-- with the proposed row's (under penalty the count is the cost, as in the
-- single take). Windows, overflow and the returned instants are as in
-- FixedWindowTake. The statement's own figures sit in a one-row subquery
-- that is not flattened (OFFSET 0), so that a prepared statement's generic
-- plan costs what a custom one does and PostgreSQL stops planning it anew
-- for every batch (with the figures spelled out per row it never did, and
-- planning took longer than running).
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
SELECT (sqlc.arg(keys)::bytea[])[i] AS key, pgrl_from_epoch_us(p.end_us) AS expires_at, s.count, s.allowed,
       p.ts AS updated_at
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts,
               pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), sqlc.arg(window_us)::bigint) AS end_us,
               sqlc.arg(max_count)::bigint AS max_count, sqlc.arg(penalty)::boolean AS penalty
        OFFSET 0) AS p,
       generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i,
       LATERAL pgrl_fixed_window_take(p.end_us, 0, (sqlc.arg(costs)::bigint[])[i], p.max_count, p.penalty,
                                      false) AS s
 ORDER BY 1
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count,
                                       excluded.count,
                                       sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).count,
       allowed = excluded.allowed
                 AND (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count,
                                             excluded.count,
                                             sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING encode(key, 'hex') AS key_hex, count, pgrl_us(expires_at) AS expires_at_us, allowed,
          pgrl_us(updated_at) AS now_us;

-- name: FixedWindowTakePolicy :one
-- FixedWindowTakePolicy is FixedWindowTake with the limit stored in the
-- database: the limit, window and penalty are read, in this same statement,
-- from the pgrl_policy row named policy and the key's pgrl_policy_override
-- (override_key is the key stored under the policy's own name; an override
-- applies until its expires_at), so that a changed policy is obeyed by the
-- very next check of every process. The caller names the counter row (key)
-- and so must know the window, the algorithm and the key mode: when the
-- policy (with the key's override) no longer has window_us, is no longer a
-- fixed window, no longer stores keys in key_mode ('hashed' or 'readable'),
-- or does not exist, nothing is counted and no row comes back: reload the
-- policy and check again. max_count is the limit that was applied. The
-- figures read in the insert arm reach the update arm in the proposed row
-- (excluded.policy_limit, excluded.policy_penalty; migration 000013), so the
-- statement reads the policy once. OFFSET 0 keeps the figures a subquery of
-- their own, computed once per statement: pulled up into the outer query, every
-- call of the step would be inlined with the lookups' expressions in place of
-- its arguments, and evaluate them again.
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at, policy_limit, policy_penalty)
SELECT sqlc.arg(key)::bytea, pgrl_from_epoch_us(f.end_us),
       (pgrl_fixed_window_take(f.end_us, 0, sqlc.arg(cost)::bigint, f.max_count, f.penalty, false)).count,
       (pgrl_fixed_window_take(f.end_us, 0, sqlc.arg(cost)::bigint, f.max_count, f.penalty, false)).allowed,
       f.ts, f.max_count, f.penalty
  FROM (SELECT coalesce(o."limit", p."limit") AS max_count, p.penalty, pgrl_now(sqlc.narg(at)::timestamptz) AS ts,
               pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), sqlc.arg(window_us)::bigint) AS end_us
          FROM pgrl_policy AS p
          LEFT JOIN pgrl_policy_override AS o
            ON o.policy = p.name AND o.key = sqlc.arg(override_key)::bytea
           AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
         WHERE p.name = sqlc.arg(policy)::text AND p.algorithm = 'fixed_window'
           AND p.key_mode = sqlc.arg(key_mode)::text
           AND round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint
               = sqlc.arg(window_us)::bigint
        OFFSET 0) AS f
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                       excluded.policy_limit, excluded.policy_penalty, false)).count,
       allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                         excluded.policy_limit, excluded.policy_penalty, false)).allowed,
       updated_at = excluded.updated_at,
       policy_limit = excluded.policy_limit,
       policy_penalty = excluded.policy_penalty
RETURNING count, pgrl_us(expires_at) AS expires_at_us, allowed, pgrl_us(updated_at) AS now_us,
          policy_limit::bigint AS max_count;

-- name: FixedWindowTakeManyPolicy :many
-- FixedWindowTakeManyPolicy is FixedWindowTakeMany with the limit stored in
-- the database, read in this same statement for each key under the rules
-- of FixedWindowTakePolicy: policy's row, and the key's override
-- (override_keys[i] is keys[i]'s key stored under the policy's own name)
-- while it lasts. A key whose policy no longer matches (see there) is not
-- counted and does not come back: the caller decides it on its own. The
-- figures read for each key reach the update arm in the proposed row
-- (excluded.policy_limit, excluded.policy_penalty), and the update arm reads
-- the check's charge back from it as FixedWindowTakeMany's does. max_count is
-- the limit that was applied.
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at, policy_limit, policy_penalty)
SELECT (@keys::bytea[])[f.i] AS key, pgrl_from_epoch_us(p.end_us) AS expires_at, s.count, s.allowed,
       p.ts AS updated_at, f.max_count, f.penalty
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts,
               pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), @window_us::bigint) AS end_us
        OFFSET 0) AS p,
       LATERAL (SELECT i, coalesce(o."limit", pol."limit") AS max_count, pol.penalty
                  FROM generate_subscripts(@keys::bytea[], 1) AS i
                  JOIN pgrl_policy AS pol
                    ON pol.name = @policy::text AND pol.algorithm = 'fixed_window' AND pol.key_mode = @key_mode::text
                  LEFT JOIN LATERAL (
                        -- One index probe per key (LIMIT 1: the key is the primary
                        -- key's), not a join of the policy's every override.
                        SELECT o."limit", o."window" FROM pgrl_policy_override AS o
                         WHERE o.policy = pol.name AND o.key = (@override_keys::bytea[])[i]
                           AND (o.expires_at IS NULL OR o.expires_at > p.ts)
                         LIMIT 1) AS o ON true
                 WHERE round(date_part('epoch', coalesce(o."window", pol."window")) * 1000000)::bigint
                       = @window_us::bigint) AS f,
       LATERAL pgrl_fixed_window_take(p.end_us, 0, (@costs::bigint[])[f.i], f.max_count, f.penalty, false) AS s
 ORDER BY 1
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count,
                                       excluded.count,
                                       excluded.policy_limit, excluded.policy_penalty, false)).count,
       allowed = excluded.allowed
                 AND (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count,
                                             excluded.count,
                                             excluded.policy_limit, excluded.policy_penalty, false)).allowed,
       updated_at = excluded.updated_at,
       policy_limit = excluded.policy_limit,
       policy_penalty = excluded.policy_penalty
RETURNING encode(key, 'hex') AS key_hex, count, pgrl_us(expires_at) AS expires_at_us, allowed,
          pgrl_us(updated_at) AS now_us, policy_limit::bigint AS max_count;

-- name: FixedWindowTakeUnderPolicy :one
-- FixedWindowTakeUnderPolicy is FixedWindowTake with the figures the caller
-- holds for the stored policy named policy (max_count, window_us, penalty),
-- counted only while that policy's row still holds them, for a fixed window
-- storing keys in key_mode, and either has no override (has_overrides,
-- migration 000020) or still has overrides_revision (migration 000021): the
-- caller sends it for a key that had no override at that revision, read
-- with the revision's keys in one statement (PolicyOverrideKeys). The
-- policy's row is read in this same statement, so that a changed policy is
-- obeyed by the very next check of every process. When it no longer
-- matches, or its overrides' keys changed, nothing is counted and no row
-- comes back: send FixedWindowTakePolicy, which reads the key's override
-- (and read the keys again). The statement reads one row of pgrl_policy and no other table,
-- which is what makes it cheaper than FixedWindowTakePolicy; the counter
-- row's policy_limit and policy_penalty are left as they are (only
-- FixedWindowTakePolicy's own update arm reads them, from its proposed row).
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
SELECT @key::bytea,
       pgrl_from_epoch_us(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), @window_us::bigint)),
       (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), @window_us::bigint), 0,
                               @cost::bigint, @max_count::bigint, @penalty::boolean, false)).count,
       (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz), @window_us::bigint), 0,
                               @cost::bigint, @max_count::bigint, @penalty::boolean, false)).allowed,
       pgrl_now(sqlc.narg(at)::timestamptz)
  FROM pgrl_policy AS p
 WHERE p.name = @policy::text AND p.algorithm = 'fixed_window' AND p.key_mode = @key_mode::text
   AND (NOT p.has_overrides OR p.overrides_revision = @overrides_revision::bigint)
   AND p."limit" = @max_count::bigint AND p.penalty = @penalty::boolean
   AND round(date_part('epoch', p."window") * 1000000)::bigint = @window_us::bigint
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, @cost::bigint,
                                       @max_count::bigint, @penalty::boolean, false)).count,
       allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, @cost::bigint,
                                         @max_count::bigint, @penalty::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING count, pgrl_us(expires_at) AS expires_at_us, allowed, pgrl_us(updated_at) AS now_us;
