-- name: FixedWindowTake :one
-- FixedWindowTake counts cost units against the key's current window in one
-- statement and returns the window's state after the check: the key's row of
-- that window is inserted, or updated by the upsert's update arm, with what
-- the fixed window's step (pgrl_fixed_window_take, migration 000012) makes
-- of it. A check is allowed when count + cost <= max_count. A denied check
-- adds nothing, unless penalty is set: then every attempt is counted, the
-- count stopping at the largest bigint (a negative cost, which only direct
-- callers of this query pass, takes units back). Windows are aligned on the
-- database clock: multiples of window_us microseconds since the Unix epoch,
-- floored (also before 1970). Instants are returned as microseconds since
-- the Unix epoch, so that no session setting (DateStyle, TimeZone) shapes
-- them; now_us is the check's instant, kept in the row's updated_at. at pins
-- the clock for tests; production leaves it nil and the database's now()
-- decides: the transaction's start, which for a check sent on its own is the
-- statement's, and which gives every check of one multi-limit batch the same
-- instant. The statement is one INSERT ... VALUES whose update arm calls
-- only IMMUTABLE functions, reading the window from the proposed row
-- (excluded), as a distributed PostgreSQL (Citus) requires.
INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
VALUES (sqlc.arg(key)::bytea,
        pgrl_from_epoch_us(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                              sqlc.arg(window_us)::bigint)),
        (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                   sqlc.arg(window_us)::bigint), 0,
                                sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                false)).count,
        (pgrl_fixed_window_take(pgrl_window_end_us(pgrl_now_us(sqlc.narg(at)::timestamptz),
                                                   sqlc.arg(window_us)::bigint), 0,
                                sqlc.arg(cost)::bigint, sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean,
                                false)).allowed,
        pgrl_now(sqlc.narg(at)::timestamptz))
ON CONFLICT (key, expires_at) DO UPDATE
   SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                       sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).count,
       allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, sqlc.arg(cost)::bigint,
                                         sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING count, pgrl_us(expires_at) AS expires_at_us, allowed, pgrl_us(updated_at) AS now_us;

-- name: FixedWindowTakeMany :many
-- FixedWindowTakeMany is FixedWindowTake for several keys at once: it
-- decides many checks of one limiter in one statement, one check per
-- distinct key, so that concurrent checks can share one round trip. Each row
-- gets exactly the step of the single check. Rows are inserted, and so
-- locked, in key order: concurrent batches never deadlock. Keys must be
-- distinct within one call (one statement cannot update a row twice). Keys
-- come back hex-encoded (key_hex), which no session setting changes
-- (bytea_output does change bytea's text form). The update arm cannot see
-- the arrays, so it reads each check's cost back from the proposed row: its
-- count, which the step made the cost itself unless the cost alone is over
-- max_count (then allowed is false, and any cost over max_count decides the
-- same). Windows, overflow and the returned instants are as in
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
                                       CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                            ELSE 9223372036854775807 END,
                                       sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).count,
       allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count,
                                         CASE WHEN excluded.allowed OR sqlc.arg(penalty)::boolean THEN excluded.count
                                              ELSE 9223372036854775807 END,
                                         sqlc.arg(max_count)::bigint, sqlc.arg(penalty)::boolean, false)).allowed,
       updated_at = excluded.updated_at
RETURNING encode(key, 'hex') AS key_hex, count, pgrl_us(expires_at) AS expires_at_us, allowed,
          pgrl_us(updated_at) AS now_us;

-- name: FixedWindowPeek :one
-- FixedWindowPeek reports the key's current window without counting anything.
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts) AS c
), win AS (
    SELECT clock.now_us, pgrl_window_end_us(clock.now_us, sqlc.arg(window_us)::bigint) AS expires_us
      FROM clock
)
SELECT coalesce((SELECT t.count FROM pgrl_fixed_window AS t
                  WHERE t.key = sqlc.arg(key)::bytea
                    AND t.expires_at = pgrl_from_epoch_us(win.expires_us)), 0)::bigint AS count,
       win.expires_us::bigint AS expires_at_us,
       win.now_us::bigint AS now_us
  FROM win;

-- name: FixedWindowReset :execrows
-- FixedWindowReset forgets every window of the key.
DELETE FROM pgrl_fixed_window WHERE key = sqlc.arg(key)::bytea;

-- name: FixedWindowTakeQueue :many
-- FixedWindowTakeQueue decides queues of checks, several per key, each key's
-- row locked and written once: the checks of a key are decided one after
-- another in the order given, exactly as that many FixedWindowTake
-- statements at the same instant would decide them, and each gets a row
-- with the window's state right after it. A check with up_to set is a
-- partial grant: it takes what is left of its cost, possibly nothing, and
-- reports it in granted (an all-or-nothing check's granted is its cost or
-- 0); its cost is a ceiling, taken as the key's max_count when above it,
-- also for what penalty charges. keys are sorted; ends[i] is the 1-based
-- position in costs of key i's last check; the limit's figures come one per
-- key, so that the keys of several limiters share one statement. See
-- pgrl_fixed_window_take_queue (migrations 000006 and 000010). check_index
-- is the check's position in costs.
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.count::bigint AS count,
       q.allowed::boolean AS allowed, q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM pgrl_fixed_window_take_queue(sqlc.arg(keys)::bytea[], sqlc.arg(costs)::bigint[],
                                    sqlc.arg(up_to)::boolean[], sqlc.arg(ends)::integer[],
                                    sqlc.arg(max_counts)::bigint[], sqlc.arg(windows_us)::bigint[],
                                    sqlc.arg(penalties)::boolean[], sqlc.narg(at)::timestamptz) AS q;

-- name: FixedWindowTakeUpTo :one
-- FixedWindowTakeUpTo is a partial grant: it takes as many of n units as
-- the key's window has left (possibly none, which is a denial) and returns
-- that number as granted, with the window's state after it. n is a ceiling,
-- not a cost: any n >= 1 is valid, and an n above max_count is taken as
-- max_count (migration 000010). Under penalty the ask is counted whatever is
-- granted: n, or max_count when n is above it.
SELECT q.granted::bigint AS granted, q.count::bigint AS count, q.allowed::boolean AS allowed,
       q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM pgrl_fixed_window_take_queue(ARRAY[sqlc.arg(key)::bytea], ARRAY[sqlc.arg(n)::bigint], ARRAY[true],
                                    ARRAY[1], ARRAY[sqlc.arg(max_count)::bigint], ARRAY[sqlc.arg(window_us)::bigint],
                                    ARRAY[sqlc.arg(penalty)::boolean], sqlc.narg(at)::timestamptz) AS q;

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
-- statement reads the policy once.
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
               = sqlc.arg(window_us)::bigint) AS f
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
