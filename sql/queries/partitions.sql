-- Queries that make pgrl_fixed_window's partitions ahead, outside the
-- request path (ratelimit.EnsurePartitions). They run DDL: call them as the
-- owner of pgrl's tables.

-- name: FixedWindowEnsurePartitionsFrom :one
-- FixedWindowEnsurePartitionsFrom creates, in the partitioned layout, missing
-- partitions from at (the database clock when null) to at + ahead_us
-- microseconds, at most 64 in this call, and returns how many it created (0
-- in the plain layout). Call it again while it returns 64.
SELECT pgrl_fixed_window_ensure_partitions(
           coalesce(sqlc.narg(at)::timestamptz, statement_timestamp()),
           coalesce(sqlc.narg(at)::timestamptz, statement_timestamp())
               + sqlc.arg(ahead_us)::bigint * interval '1 microsecond'
       )::integer AS created;
