-- The run statements decide the commonest batch of coalesced checks
-- without a check function: each key (keys, ascending, once each) has a
-- run of lone checks of one unit, all or nothing, without penalty, at its
-- row's figures; rows[j] is check j's 1-based key, the runs following one
-- another in key order, and ends[k] is the position of key k's last check
-- (its run is checks ends[k-1]+1 to ends[k]). The checks are decided as the
-- check functions decide them, one after another. The algorithm's step, with the
-- run's length as a partial grant (up_to), says how many of a run's
-- checks are admitted: checks of one unit admitted one after another stop
-- where a partial grant does. The step of no units brings the row to now
-- (the sliding window rolled on, the bucket refilled); check j's state is
-- that state with the admitted checks up to j taken, one unit each, and
-- the row is written once, with the state after its last check. Each
-- existing row is read FOR UPDATE, in key order: keys ascend, and each
-- key's row is found and locked by a probe of the primary key of its own
-- (LATERAL), then written through the primary key (key = ANY of the keys
-- read). Joined to the keys array, the table was hashed whole on every
-- call, the planner taking the array for a thousand keys (gen's
-- TestStatementsProbeTheirRows); and no estimate depends on the arrays'
-- contents, which a custom plan sees and a generic one does not, so that
-- the generic plan is as cheap as a custom one and is used (otherwise
-- PostgreSQL plans such a statement anew on every call). A key whose row does not
-- exist (or was deleted under the statement) is not decided: no row comes
-- back for its checks, nothing is counted for them, and the caller sends
-- them in a check statement (…TakeChecks), which makes the row. The rows
-- that come back are those of …TakeChecks, check_index being j.

-- name: FixedWindowTakeRuns :many
WITH p AS (
    SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us
    OFFSET 0
), o AS MATERIALIZED (
    SELECT r.k, r.n, r.before, r.end_us, t.key, t.count,
           (pgrl_fixed_window_take(r.end_us, t.count, r.n, r.max_count, false, true)).granted AS granted
      FROM (SELECT k, (@keys::bytea[])[k] AS key, (@max_counts::bigint[])[k] AS max_count,
                   (@ends::integer[])[k] - coalesce((@ends::integer[])[k - 1], 0) AS n,
                   pgrl_window_end_us(p.now_us, (@windows_us::bigint[])[k]) AS end_us,
                   coalesce((@ends::integer[])[k - 1], 0) AS before
              FROM p, generate_subscripts(@keys::bytea[], 1) AS k) AS r
     CROSS JOIN LATERAL (SELECT t.key, t.count
                           FROM pgrl_fixed_window AS t
                          WHERE t.key = r.key AND t.expires_at = pgrl_from_epoch_us(r.end_us)
                            FOR UPDATE) AS t
), u AS (
    UPDATE pgrl_fixed_window AS t
       SET count = o.count + o.granted, allowed = o.granted = o.n, updated_at = greatest(t.updated_at, p.ts)
      FROM p, o
     WHERE t.key = ANY (ARRAY(SELECT o.key FROM o)) AND t.key = o.key AND t.expires_at = pgrl_from_epoch_us(o.end_us)
    RETURNING o.k, o.before, o.count, o.granted, o.end_us
)
SELECT j::integer AS check_index, a.allowed::integer::bigint AS granted, (u.count + a.taken)::bigint AS count,
       a.allowed::boolean AS allowed, u.end_us::bigint AS expires_at_us, p.now_us::bigint AS now_us
  FROM generate_subscripts(@rows::integer[], 1) AS j
  JOIN u ON u.k = (@rows::integer[])[j]
 CROSS JOIN p
 CROSS JOIN LATERAL (SELECT j - u.before <= u.granted AS allowed, least(j - u.before, u.granted) AS taken) AS a
 ORDER BY 1;

-- name: TokenBucketTakeRuns :many
-- The bucket's capacity less what its slices hold on lease (migration
-- 000016) is what the checks count against, as in the check function.
WITH p AS (
    SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us
    OFFSET 0
), o AS MATERIALIZED (
    SELECT r.k, r.n, r.before, r.capacity, r.refill_per_us, t.key, t.tokens,
           pgrl_us(t.updated_at) AS updated_at_us,
           r.capacity - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev, p.now_us) AS cap,
           pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev) AS over_at
      FROM p
     CROSS JOIN (SELECT k, (@keys::bytea[])[k] AS key,
                        (@ends::integer[])[k] - coalesce((@ends::integer[])[k - 1], 0) AS n,
                        (@capacities::float8[])[k] AS capacity, (@refills_per_us::float8[])[k] AS refill_per_us,
                        coalesce((@ends::integer[])[k - 1], 0) AS before
                   FROM generate_subscripts(@keys::bytea[], 1) AS k) AS r
     CROSS JOIN LATERAL (SELECT t.key, t.tokens, t.updated_at, t.lease_epoch_us, t.leased, t.leased_prev
                           FROM pgrl_token_bucket AS t
                          WHERE t.key = r.key
                            FOR UPDATE) AS t
), g AS MATERIALIZED (
    SELECT o.k, o.n, o.before, o.capacity, o.refill_per_us, o.over_at, o.key,
           (pgrl_token_bucket_take(o.tokens, o.updated_at_us, p.now_us, 0, o.cap, o.refill_per_us, false,
                                   false)).tokens AS tokens,
           (pgrl_token_bucket_take(o.tokens, o.updated_at_us, p.now_us, 0, o.cap, o.refill_per_us, false,
                                   false)).updated_at_us AS updated_at_us,
           (pgrl_token_bucket_take(o.tokens, o.updated_at_us, p.now_us, o.n, o.cap, o.refill_per_us, false,
                                   true)).granted AS granted
      FROM p, o
), u AS (
    UPDATE pgrl_token_bucket AS t
       SET tokens = g.tokens - g.granted, updated_at = pgrl_from_epoch_us(g.updated_at_us),
           full_at = greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(g.updated_at_us), g.tokens - g.granted,
                                                        g.capacity, g.refill_per_us), g.over_at),
           allowed = g.granted = g.n
      FROM g
     WHERE t.key = ANY (ARRAY(SELECT g.key FROM g)) AND t.key = g.key
    RETURNING g.k, g.before, g.tokens, g.updated_at_us, g.granted, g.capacity, g.refill_per_us, g.over_at
)
SELECT j::integer AS check_index, a.allowed::integer::bigint AS granted,
       pgrl_float8_bits(a.tokens)::bigint AS tokens_bits, u.updated_at_us::bigint AS updated_at_us,
       pgrl_epoch_us(greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u.updated_at_us), a.tokens, u.capacity,
                                                        u.refill_per_us), u.over_at))::bigint AS full_at_us,
       a.allowed::boolean AS allowed
  FROM generate_subscripts(@rows::integer[], 1) AS j
  JOIN u ON u.k = (@rows::integer[])[j]
 CROSS JOIN LATERAL (SELECT j - u.before <= u.granted AS allowed,
                            u.tokens - least(j - u.before, u.granted) AS tokens) AS a
 ORDER BY 1;

-- name: SlidingWindowTakeRuns :many
WITH p AS (
    SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts, pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us
    OFFSET 0
), o AS MATERIALIZED (
    SELECT r.k, r.n, r.before, r.max_count, r.window_us, t.key, pgrl_us(t.window_start) AS window_start_us, t.count,
           t.prev_count
      FROM (SELECT k, (@keys::bytea[])[k] AS key, (@max_counts::bigint[])[k] AS max_count,
                   (@ends::integer[])[k] - coalesce((@ends::integer[])[k - 1], 0) AS n,
                   (@windows_us::bigint[])[k] AS window_us,
                   coalesce((@ends::integer[])[k - 1], 0) AS before
              FROM generate_subscripts(@keys::bytea[], 1) AS k) AS r
     CROSS JOIN LATERAL (SELECT t.key, t.window_start, t.count, t.prev_count
                           FROM pgrl_sliding_window AS t
                          WHERE t.key = r.key
                            FOR UPDATE) AS t
), g AS MATERIALIZED (
    SELECT o.k, o.n, o.before, o.window_us, o.key,
           (pgrl_sliding_window_take(o.window_start_us, o.count, o.prev_count, p.now_us, o.window_us, 0,
                                     o.max_count, false, false)).window_start_us AS window_start_us,
           (pgrl_sliding_window_take(o.window_start_us, o.count, o.prev_count, p.now_us, o.window_us, 0,
                                     o.max_count, false, false)).count AS count,
           (pgrl_sliding_window_take(o.window_start_us, o.count, o.prev_count, p.now_us, o.window_us, 0,
                                     o.max_count, false, false)).prev_count AS prev_count,
           (pgrl_sliding_window_take(o.window_start_us, o.count, o.prev_count, p.now_us, o.window_us, o.n,
                                     o.max_count, false, true)).granted AS granted
      FROM p, o
), u AS (
    UPDATE pgrl_sliding_window AS t
       SET window_start = pgrl_from_epoch_us(g.window_start_us), count = g.count + g.granted,
           prev_count = g.prev_count, expires_at = pgrl_from_epoch_us(g.window_start_us + 2 * g.window_us),
           allowed = g.granted = g.n, updated_at = greatest(t.updated_at, p.ts)
      FROM p, g
     WHERE t.key = ANY (ARRAY(SELECT g.key FROM g)) AND t.key = g.key
    RETURNING g.k, g.before, g.window_start_us, g.count, g.prev_count, g.granted
)
SELECT j::integer AS check_index, a.allowed::integer::bigint AS granted, u.window_start_us::bigint AS window_start_us,
       (u.count + a.taken)::bigint AS count, u.prev_count::bigint AS prev_count, a.allowed::boolean AS allowed,
       p.now_us::bigint AS now_us
  FROM generate_subscripts(@rows::integer[], 1) AS j
  JOIN u ON u.k = (@rows::integer[])[j]
 CROSS JOIN p
 CROSS JOIN LATERAL (SELECT j - u.before <= u.granted AS allowed, least(j - u.before, u.granted) AS taken) AS a
 ORDER BY 1;
