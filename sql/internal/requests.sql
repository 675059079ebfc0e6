-- The check statements of checks that carry a request id
-- (ratelimit.RequestID; migration 000017): the check statement of one
-- check (…TakeChecks), and in the same statement its answer stored in
-- pgrl_request under (request_key, request_id). When the id is stored
-- already, the check is not made: the stored answer comes back instead,
-- with replayed true. Two checks of one id at once: the second fails with
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
