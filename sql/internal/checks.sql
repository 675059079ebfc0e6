-- The check statements the library sends for several checks at once
-- (coalesced checks, and the limits of one AllowAll decision): each
-- decides runs of checks in the order given, against rows given once each
-- in ascending key order with their limit's figures: a run of one row's
-- checks (runs[g] its row), each applied, or an all-or-nothing group
-- (runs[g] 0), applied together or not at all (migration 000014). ends[g]
-- is the 1-based position of run g's last check, rows[j] check j's 1-based
-- row; a check without a veto (a limit in shadow mode) does not stop its
-- group. check_index is the check's 1-based position. They take slices too
-- (ratelimit.Slice; migration 000015, and 000016 for the token bucket, whose
-- slices also count against its capacity while out on lease): mins and
-- shares per check, 0 for any other check.

-- name: FixedWindowTakeChecks :many
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.count::bigint AS count,
       q.allowed::boolean AS allowed, q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM pgrl_fixed_window_take_checks(@keys::bytea[], @max_counts::bigint[], @windows_us::bigint[],
                                     @penalties::boolean[], @runs::integer[], @ends::integer[], @rows::integer[],
                                     @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[],
                                     @shares::bigint[], sqlc.narg(at)::timestamptz) AS q;

-- name: TokenBucketTakeChecks :many
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.tokens_bits::bigint AS tokens_bits,
       q.updated_at_us::bigint AS updated_at_us, q.full_at_us::bigint AS full_at_us, q.allowed::boolean AS allowed
  FROM pgrl_token_bucket_take_checks(@keys::bytea[], @capacities::float8[], @refills_per_us::float8[],
                                     @penalties::boolean[], @runs::integer[], @ends::integer[], @rows::integer[],
                                     @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[],
                                     @shares::bigint[], sqlc.narg(at)::timestamptz) AS q;

-- name: SlidingWindowTakeChecks :many
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
       q.window_start_us::bigint AS window_start_us, q.count::bigint AS count,
       q.prev_count::bigint AS prev_count, q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
  FROM pgrl_sliding_window_take_checks(@keys::bytea[], @max_counts::bigint[], @windows_us::bigint[],
                                       @penalties::boolean[], @runs::integer[], @ends::integer[], @rows::integer[],
                                       @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[],
                                       @shares::bigint[], sqlc.narg(at)::timestamptz) AS q;

-- name: FixedWindowTakePolicyChecks :many
-- FixedWindowTakePolicyChecks is FixedWindowTakeChecks with rows that read
-- their figures from a stored policy (ratelimit.Config.Policy), so that
-- concurrent checks of a policy's limiters share a round trip as other
-- checks do: policies[k] names row k's policy (empty for a row counted at
-- the figures given), override_keys[k] is its key as the policy's
-- overrides store it, and key_modes[k] how the policy must store keys. A
-- policy row's figures are read as FixedWindowTakePolicy reads them: the
-- policy's, or those of the key's override while it lasts. When any policy
-- row no longer matches (its policy is missing, or is now another
-- algorithm or key mode, or has another window for that key), no check is
-- decided, nothing is counted and no row comes back: the caller then
-- decides each check on its own, and the one whose policy changed learns
-- it. The check function is then given no rows and no runs, so that this
-- holds whatever plan the statement gets. max_count is the limit each
-- check was counted against.
WITH f AS MATERIALIZED (
    SELECT r.k,
           r.policy = '' OR p.name IS NOT NULL
               AND round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint = r.window_us
               AS valid,
           CASE WHEN r.policy = '' THEN r.max_count ELSE coalesce(o."limit", p."limit") END AS max_count,
           CASE WHEN r.policy = '' THEN r.penalty ELSE p.penalty END AS penalty
      FROM (SELECT k, (@policies::text[])[k] AS policy, (@override_keys::bytea[])[k] AS override_key,
                   (@key_modes::text[])[k] AS key_mode, (@max_counts::bigint[])[k] AS max_count,
                   (@windows_us::bigint[])[k] AS window_us, (@penalties::boolean[])[k] AS penalty
              FROM generate_subscripts(@policies::text[], 1) AS k) AS r
      -- One index probe per row for each (LIMIT 1: the primary keys'), not
      -- a join of every policy and override.
      LEFT JOIN LATERAL (SELECT p.name, p."limit", p."window", p.burst, p.penalty FROM pgrl_policy AS p
                          WHERE p.name = r.policy AND p.algorithm = 'fixed_window' AND p.key_mode = r.key_mode
                          LIMIT 1) AS p ON true
      LEFT JOIN LATERAL (SELECT o."limit", o."window", o.burst FROM pgrl_policy_override AS o
                          WHERE o.policy = p.name AND o.key = r.override_key
                            AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
                          LIMIT 1) AS o ON true
), g AS (
    SELECT bool_and(f.valid) AS ok, array_agg(f.max_count ORDER BY f.k) AS max_counts,
           array_agg(f.penalty ORDER BY f.k) AS penalties
      FROM f
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.count::bigint AS count,
       q.allowed::boolean AS allowed, q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us,
       f.max_count::bigint AS max_count
  FROM g
 CROSS JOIN LATERAL pgrl_fixed_window_take_checks(
           CASE WHEN g.ok THEN @keys::bytea[] ELSE '{}' END, g.max_counts, @windows_us::bigint[], g.penalties,
           CASE WHEN g.ok THEN @runs::integer[] ELSE '{}' END, @ends::integer[], @rows::integer[],
           @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
           sqlc.narg(at)::timestamptz) AS q
  JOIN f ON f.k = (@rows::integer[])[q.check_index];

-- name: TokenBucketTakePolicyChecks :many
-- TokenBucketTakePolicyChecks is TokenBucketTakeChecks with rows that read
-- their rate from a stored policy, as FixedWindowTakePolicyChecks. A key
-- has one bucket whatever its rate, so a token bucket policy may
-- change its window; an override the policy no longer admits is ignored,
-- as in TokenBucketTakePolicy. capacities and refills_per_us are a plain
-- row's figures; a policy row's are its burst, and its limit over its
-- window. limit, window_us and burst are the rate each check was counted
-- at (0 for a plain row).
WITH f AS MATERIALIZED (
    SELECT x.k, x.valid, x.capacity, x.refill_per_us, x.penalty,
           coalesce(x."limit", 0) AS "limit", coalesce(x.window_us, 0) AS window_us, coalesce(x.burst, 0) AS burst
      FROM (SELECT r.k, r.policy = '' OR p.name IS NOT NULL AS valid,
                   CASE WHEN r.policy = '' THEN r.capacity
                        ELSE coalesce(o.burst, p.burst, o."limit", p."limit")::float8 END AS capacity,
                   CASE WHEN r.policy = '' THEN r.refill_per_us
                        ELSE coalesce(o."limit", p."limit")::float8
                             / round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::float8
                   END AS refill_per_us,
                   CASE WHEN r.policy = '' THEN r.penalty ELSE p.penalty END AS penalty,
                   coalesce(o."limit", p."limit") AS "limit",
                   round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint AS window_us,
                   coalesce(o.burst, p.burst, o."limit", p."limit") AS burst
              FROM (SELECT k, (@policies::text[])[k] AS policy, (@override_keys::bytea[])[k] AS override_key,
                           (@key_modes::text[])[k] AS key_mode, (@capacities::float8[])[k] AS capacity,
                           (@refills_per_us::float8[])[k] AS refill_per_us, (@penalties::boolean[])[k] AS penalty
                      FROM generate_subscripts(@policies::text[], 1) AS k) AS r
              -- One index probe per row for each (LIMIT 1: the primary keys'), not
              -- a join of every policy and override.
              LEFT JOIN LATERAL (SELECT p.name, p."limit", p."window", p.burst, p.penalty FROM pgrl_policy AS p
                                  WHERE p.name = r.policy AND p.algorithm = 'token_bucket' AND p.key_mode = r.key_mode
                                  LIMIT 1) AS p ON true
              LEFT JOIN LATERAL (SELECT o."limit", o."window", o.burst FROM pgrl_policy_override AS o
                                  WHERE o.policy = p.name AND o.key = r.override_key
                                    AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
                                  LIMIT 1) AS o
                ON coalesce(o.burst, p.burst, o."limit", p."limit") <= 9007199254740992
               AND coalesce(o.burst, p.burst, o."limit", p."limit")::numeric
                   * round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::numeric
                   <= coalesce(o."limit", p."limit")::numeric * 31557600000000000) AS x
), g AS (
    SELECT bool_and(f.valid) AS ok, array_agg(f.capacity ORDER BY f.k) AS capacities,
           array_agg(f.refill_per_us ORDER BY f.k) AS refills_per_us, array_agg(f.penalty ORDER BY f.k) AS penalties
      FROM f
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.tokens_bits::bigint AS tokens_bits,
       q.updated_at_us::bigint AS updated_at_us, q.full_at_us::bigint AS full_at_us, q.allowed::boolean AS allowed,
       f."limit"::bigint AS "limit", f.window_us::bigint AS window_us, f.burst::bigint AS burst
  FROM g
 CROSS JOIN LATERAL pgrl_token_bucket_take_checks(
           CASE WHEN g.ok THEN @keys::bytea[] ELSE '{}' END, g.capacities, g.refills_per_us, g.penalties,
           CASE WHEN g.ok THEN @runs::integer[] ELSE '{}' END, @ends::integer[], @rows::integer[],
           @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
           sqlc.narg(at)::timestamptz) AS q
  JOIN f ON f.k = (@rows::integer[])[q.check_index];

-- name: SlidingWindowTakePolicyChecks :many
-- SlidingWindowTakePolicyChecks is SlidingWindowTakeChecks with rows that
-- read their figures from a stored policy, as FixedWindowTakePolicyChecks.
WITH f AS MATERIALIZED (
    SELECT r.k,
           r.policy = '' OR p.name IS NOT NULL
               AND round(date_part('epoch', coalesce(o."window", p."window")) * 1000000)::bigint = r.window_us
               AS valid,
           CASE WHEN r.policy = '' THEN r.max_count ELSE coalesce(o."limit", p."limit") END AS max_count,
           CASE WHEN r.policy = '' THEN r.penalty ELSE p.penalty END AS penalty
      FROM (SELECT k, (@policies::text[])[k] AS policy, (@override_keys::bytea[])[k] AS override_key,
                   (@key_modes::text[])[k] AS key_mode, (@max_counts::bigint[])[k] AS max_count,
                   (@windows_us::bigint[])[k] AS window_us, (@penalties::boolean[])[k] AS penalty
              FROM generate_subscripts(@policies::text[], 1) AS k) AS r
      -- One index probe per row for each (LIMIT 1: the primary keys'), not
      -- a join of every policy and override.
      LEFT JOIN LATERAL (SELECT p.name, p."limit", p."window", p.burst, p.penalty FROM pgrl_policy AS p
                          WHERE p.name = r.policy AND p.algorithm = 'sliding_window' AND p.key_mode = r.key_mode
                          LIMIT 1) AS p ON true
      LEFT JOIN LATERAL (SELECT o."limit", o."window", o.burst FROM pgrl_policy_override AS o
                          WHERE o.policy = p.name AND o.key = r.override_key
                            AND (o.expires_at IS NULL OR o.expires_at > pgrl_now(sqlc.narg(at)::timestamptz))
                          LIMIT 1) AS o ON true
), g AS (
    SELECT bool_and(f.valid) AS ok, array_agg(f.max_count ORDER BY f.k) AS max_counts,
           array_agg(f.penalty ORDER BY f.k) AS penalties
      FROM f
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
       q.window_start_us::bigint AS window_start_us, q.count::bigint AS count,
       q.prev_count::bigint AS prev_count, q.allowed::boolean AS allowed, q.now_us::bigint AS now_us,
       f.max_count::bigint AS max_count
  FROM g
 CROSS JOIN LATERAL pgrl_sliding_window_take_checks(
           CASE WHEN g.ok THEN @keys::bytea[] ELSE '{}' END, g.max_counts, @windows_us::bigint[], g.penalties,
           CASE WHEN g.ok THEN @runs::integer[] ELSE '{}' END, @ends::integer[], @rows::integer[],
           @costs::bigint[], @up_to::boolean[], @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
           sqlc.narg(at)::timestamptz) AS q
  JOIN f ON f.k = (@rows::integer[])[q.check_index];
