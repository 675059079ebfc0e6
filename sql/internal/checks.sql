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
