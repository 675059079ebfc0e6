-- The check statements of checks that carry a request id
-- (ratelimit.RequestID; migration 000017): the check statement of one
-- check (…TakeChecks), and in the same statement its answer stored in
-- pgrl_request under (request_key, request_id). When the id is stored
-- already, the check is not made: the stored answer comes back instead,
-- with replayed true (from …TakeOnce, no row: the caller reads it with
-- …Answer). Two checks of one id at once: the second fails with
-- unique_violation on pgrl_request_pkey, counting nothing, and is sent
-- again, when it finds the first's answer. A stored answer is kept at
-- least retain_us past the check (rl-cleanup deletes it afterwards).

-- name: FixedWindowTakeChecksOnce :many
WITH seen AS (
    SELECT r.result FROM pgrl_request AS r WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea
), q AS MATERIALIZED (
    SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.count::bigint AS count,
           q.allowed::boolean AS allowed, q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
      FROM pgrl_fixed_window_take_checks(@keys::bytea[], @max_counts::bigint[], @windows_us::bigint[],
                                         @penalties::boolean[], @runs::integer[], @ends::integer[],
                                         @rows::integer[], @costs::bigint[], @up_to::boolean[],
                                         @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
                                         sqlc.narg(at)::timestamptz) AS q
     WHERE NOT EXISTS (SELECT FROM seen)
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(max(q.now_us) + @retain_us::bigint), jsonb_agg(q)
      FROM q HAVING count(*) > 0
)
SELECT q.check_index, q.granted, q.count, q.allowed, q.expires_at_us, q.now_us, false AS replayed FROM q
UNION ALL
SELECT (x->>'check_index')::integer, (x->>'granted')::bigint, (x->>'count')::bigint, (x->>'allowed')::boolean,
       (x->>'expires_at_us')::bigint, (x->>'now_us')::bigint, true
  FROM seen, jsonb_array_elements(seen.result) AS x;

-- name: TokenBucketTakeChecksOnce :many
WITH seen AS (
    SELECT r.result FROM pgrl_request AS r WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea
), q AS MATERIALIZED (
    SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
           q.tokens_bits::bigint AS tokens_bits, q.updated_at_us::bigint AS updated_at_us,
           q.full_at_us::bigint AS full_at_us, q.allowed::boolean AS allowed
      FROM pgrl_token_bucket_take_checks(@keys::bytea[], @capacities::float8[], @refills_per_us::float8[],
                                         @penalties::boolean[], @runs::integer[], @ends::integer[],
                                         @rows::integer[], @costs::bigint[], @up_to::boolean[],
                                         @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
                                         sqlc.narg(at)::timestamptz) AS q
     WHERE NOT EXISTS (SELECT FROM seen)
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(max(q.updated_at_us) + @retain_us::bigint),
           jsonb_agg(q)
      FROM q HAVING count(*) > 0
)
SELECT q.check_index, q.granted, q.tokens_bits, q.updated_at_us, q.full_at_us, q.allowed, false AS replayed FROM q
UNION ALL
SELECT (x->>'check_index')::integer, (x->>'granted')::bigint, (x->>'tokens_bits')::bigint,
       (x->>'updated_at_us')::bigint, (x->>'full_at_us')::bigint, (x->>'allowed')::boolean, true
  FROM seen, jsonb_array_elements(seen.result) AS x;

-- name: SlidingWindowTakeChecksOnce :many
WITH seen AS (
    SELECT r.result FROM pgrl_request AS r WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea
), q AS MATERIALIZED (
    SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
           q.window_start_us::bigint AS window_start_us, q.count::bigint AS count,
           q.prev_count::bigint AS prev_count, q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
      FROM pgrl_sliding_window_take_checks(@keys::bytea[], @max_counts::bigint[], @windows_us::bigint[],
                                           @penalties::boolean[], @runs::integer[], @ends::integer[],
                                           @rows::integer[], @costs::bigint[], @up_to::boolean[],
                                           @vetoes::boolean[], @mins::bigint[], @shares::bigint[],
                                           sqlc.narg(at)::timestamptz) AS q
     WHERE NOT EXISTS (SELECT FROM seen)
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(max(q.now_us) + @retain_us::bigint), jsonb_agg(q)
      FROM q HAVING count(*) > 0
)
SELECT q.check_index, q.granted, q.window_start_us, q.count, q.prev_count, q.allowed, q.now_us,
       false AS replayed
  FROM q
UNION ALL
SELECT (x->>'check_index')::integer, (x->>'granted')::bigint, (x->>'window_start_us')::bigint,
       (x->>'count')::bigint, (x->>'prev_count')::bigint, (x->>'allowed')::boolean, (x->>'now_us')::bigint, true
  FROM seen, jsonb_array_elements(seen.result) AS x;

-- name: FixedWindowTakeOnce :many
-- FixedWindowTakeOnce is FixedWindowTakeChecksOnce for one check that asks
-- for its whole cost (no partial grant, no slice): the check is
-- FixedWindowTake's upsert, with no check function between it and the
-- row, and its answer is stored in the same form, so that a retry finds it
-- whichever statement made it. When the id is stored already, nothing is
-- counted and no row comes back: the caller reads the stored answer
-- (FixedWindowAnswer). Retries are rare, and a replay read in this
-- statement cost every first check a second probe and a union.
WITH q AS (
    INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
    SELECT sqlc.arg(key)::bytea,
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
           pgrl_now(sqlc.narg(at)::timestamptz)
     WHERE NOT EXISTS (SELECT FROM pgrl_request AS r
                        WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea)
    ON CONFLICT (key, expires_at) DO UPDATE
       SET count = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, @cost::bigint,
                                           @max_count::bigint, @penalty::boolean, false)).count,
           allowed = (pgrl_fixed_window_take(pgrl_us(excluded.expires_at), t.count, @cost::bigint,
                                             @max_count::bigint, @penalty::boolean, false)).allowed,
           updated_at = excluded.updated_at
    RETURNING 1::integer AS check_index, CASE WHEN allowed THEN @cost::bigint ELSE 0 END::bigint AS granted,
              count, allowed, pgrl_us(expires_at) AS expires_at_us, pgrl_us(updated_at) AS now_us
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(q.now_us + @retain_us::bigint),
           jsonb_build_array(jsonb_build_object('check_index', q.check_index, 'granted', q.granted,
                                                'count', q.count, 'allowed', q.allowed,
                                                'expires_at_us', q.expires_at_us, 'now_us', q.now_us))
      FROM q
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.count::bigint AS count,
       q.allowed::boolean AS allowed, q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM q;

-- name: TokenBucketTakeOnce :many
-- TokenBucketTakeOnce is TokenBucketTakeChecksOnce for one check that asks
-- for its whole cost, as FixedWindowTakeOnce: the check is
-- TokenBucketTake's upsert.
WITH q AS (
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
     WHERE NOT EXISTS (SELECT FROM pgrl_request AS r
                        WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea)
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
                                  (pgrl_token_bucket_take(t.tokens, 0,
                                                          pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                                          sqlc.arg(cost)::bigint,
                                                          sqlc.arg(capacity)::float8
                                                          - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased,
                                                                                     t.leased_prev,
                                                                                     excluded.lease_epoch_us),
                                                          sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean,
                                                          false)).tokens,
                                  sqlc.arg(capacity)::float8, sqlc.arg(refill_per_us)::float8),
                              pgrl_token_bucket_lease_over_at(t.lease_epoch_us, t.leased, t.leased_prev)),
           allowed = (pgrl_token_bucket_take(t.tokens, 0, pgrl_elapsed_us(t.updated_at, excluded.updated_at),
                                             sqlc.arg(cost)::bigint,
                                             sqlc.arg(capacity)::float8
                                             - pgrl_token_bucket_leased(t.lease_epoch_us, t.leased, t.leased_prev,
                                                                        excluded.lease_epoch_us),
                                             sqlc.arg(refill_per_us)::float8, sqlc.arg(penalty)::boolean,
                                             false)).allowed
    RETURNING 1::integer AS check_index, CASE WHEN allowed THEN sqlc.arg(cost)::bigint ELSE 0 END::bigint AS granted,
              pgrl_float8_bits(tokens) AS tokens_bits, pgrl_us(updated_at) AS updated_at_us,
              pgrl_us(full_at) AS full_at_us, allowed
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(q.updated_at_us + @retain_us::bigint),
           jsonb_build_array(jsonb_build_object('check_index', q.check_index, 'granted', q.granted,
                                                'tokens_bits', q.tokens_bits, 'updated_at_us', q.updated_at_us,
                                                'full_at_us', q.full_at_us, 'allowed', q.allowed))
      FROM q
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted, q.tokens_bits::bigint AS tokens_bits,
       q.updated_at_us::bigint AS updated_at_us, q.full_at_us::bigint AS full_at_us, q.allowed::boolean AS allowed
  FROM q;

-- name: SlidingWindowTakeOnce :many
-- SlidingWindowTakeOnce is SlidingWindowTakeChecksOnce for one check that
-- asks for its whole cost, as FixedWindowTakeOnce: the check is
-- SlidingWindowTake's upsert.
WITH q AS (
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
     WHERE NOT EXISTS (SELECT FROM pgrl_request AS r
                        WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea)
    ON CONFLICT (key) DO UPDATE
       SET window_start = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                            pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                            @window_us::bigint, @cost::bigint,
                                            @max_count::bigint, @penalty::boolean, false)).window_start_us),
           count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                            pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                            @window_us::bigint, @cost::bigint,
                                            @max_count::bigint, @penalty::boolean, false)).count,
           prev_count = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                            pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                            @window_us::bigint, @cost::bigint,
                                            @max_count::bigint, @penalty::boolean, false)).prev_count,
           expires_at = pgrl_ts((pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                            pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                            @window_us::bigint, @cost::bigint,
                                            @max_count::bigint, @penalty::boolean, false)).window_start_us
                                + 2 * @window_us::bigint),
           allowed = (pgrl_sliding_window_take_at(pgrl_us(t.window_start), t.count, t.prev_count,
                                            pgrl_us(excluded.updated_at), pgrl_us(excluded.window_start),
                                            @window_us::bigint, @cost::bigint,
                                            @max_count::bigint, @penalty::boolean, false)).allowed,
           updated_at = excluded.updated_at
    RETURNING 1::integer AS check_index, CASE WHEN allowed THEN @cost::bigint ELSE 0 END::bigint AS granted,
              pgrl_us(window_start) AS window_start_us, count, prev_count, allowed, pgrl_us(updated_at) AS now_us
), stored AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @request_key::bytea, @request_id::bytea, pgrl_ts(q.now_us + @retain_us::bigint),
           jsonb_build_array(jsonb_build_object('check_index', q.check_index, 'granted', q.granted,
                                                'window_start_us', q.window_start_us, 'count', q.count,
                                                'prev_count', q.prev_count, 'allowed', q.allowed,
                                                'now_us', q.now_us))
      FROM q
)
SELECT q.check_index::integer AS check_index, q.granted::bigint AS granted,
       q.window_start_us::bigint AS window_start_us, q.count::bigint AS count, q.prev_count::bigint AS prev_count,
       q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
  FROM q;

-- name: FixedWindowAnswer :many
-- FixedWindowAnswer is the answer stored under a request id, as
-- FixedWindowTakeChecksOnce returns it when it finds one.
SELECT (x->>'check_index')::integer AS check_index, (x->>'granted')::bigint AS granted,
       (x->>'count')::bigint AS count, (x->>'allowed')::boolean AS allowed,
       (x->>'expires_at_us')::bigint AS expires_at_us, (x->>'now_us')::bigint AS now_us
  FROM pgrl_request AS r, jsonb_array_elements(r.result) AS x
 WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea;

-- name: TokenBucketAnswer :many
-- TokenBucketAnswer is the answer stored under a request id, as
-- TokenBucketTakeChecksOnce returns it when it finds one.
SELECT (x->>'check_index')::integer AS check_index, (x->>'granted')::bigint AS granted,
       (x->>'tokens_bits')::bigint AS tokens_bits, (x->>'updated_at_us')::bigint AS updated_at_us,
       (x->>'full_at_us')::bigint AS full_at_us, (x->>'allowed')::boolean AS allowed
  FROM pgrl_request AS r, jsonb_array_elements(r.result) AS x
 WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea;

-- name: SlidingWindowAnswer :many
-- SlidingWindowAnswer is the answer stored under a request id, as
-- SlidingWindowTakeChecksOnce returns it when it finds one.
SELECT (x->>'check_index')::integer AS check_index, (x->>'granted')::bigint AS granted,
       (x->>'window_start_us')::bigint AS window_start_us, (x->>'count')::bigint AS count,
       (x->>'prev_count')::bigint AS prev_count, (x->>'allowed')::boolean AS allowed,
       (x->>'now_us')::bigint AS now_us
  FROM pgrl_request AS r, jsonb_array_elements(r.result) AS x
 WHERE r.key = @request_key::bytea AND r.id = @request_id::bytea;

-- name: RequestsExist :one
-- RequestsExist reports whether pgrl_request exists in the search_path
-- (migration 000017).
SELECT (to_regclass('pgrl_request'::text) IS NOT NULL)::boolean AS requests_exist;

-- name: RequestDeleteExpiredBatch :execrows
-- RequestDeleteExpiredBatch deletes up to batch_size answers of request
-- ids kept past their expires_at (at_us, or now), the oldest first, by
-- primary key.
DELETE FROM pgrl_request AS r
 USING (SELECT o.key, o.id FROM pgrl_request AS o
         WHERE o.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                        statement_timestamp())
         ORDER BY o.expires_at LIMIT @batch_size::integer) AS old
 WHERE r.key = old.key AND r.id = old.id;

-- name: RequestCountExpired :one
-- RequestCountExpired counts the answers RequestDeleteExpiredBatch would
-- delete.
SELECT count(*)::bigint AS expired
  FROM pgrl_request AS r
 WHERE r.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());
