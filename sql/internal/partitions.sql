-- Queries that make pgrl_fixed_window's partitions ahead, outside the
-- request path (ratelimit.EnsurePartitions). They run DDL: call them as the
-- owner of pgrl's tables.

-- name: FixedWindowEnsurePartitionsFrom :one
-- FixedWindowEnsurePartitionsFrom creates, in the partitioned layout, missing
-- partitions from at_us (microseconds since the Unix epoch; the database
-- clock when null) to at_us + ahead_us microseconds, at most 64 in this call, and returns how many it created (0
-- in the plain layout). Call it again while it returns 64.
SELECT pgrl_fixed_window_ensure_partitions(
           coalesce(pgrl_from_epoch_us(sqlc.narg(at_us)::bigint), statement_timestamp()),
           coalesce(pgrl_from_epoch_us(sqlc.narg(at_us)::bigint), statement_timestamp())
               + sqlc.arg(ahead_us)::bigint * interval '1 microsecond'
       )::integer AS created;

-- name: FixedWindowEnsurePartition :one
-- FixedWindowEnsurePartition creates, in the partitioned layout, the
-- partition that the key's current window of window_us belongs in (windows
-- floored as FixedWindowTake floors them, also before 1970), at at_us
-- (microseconds since the Unix epoch; the database clock when null). It
-- returns how many partitions it created (0 in the plain layout).
WITH clock AS (
    SELECT c.ts, pgrl_epoch_us(c.ts) AS now_us
      FROM (SELECT coalesce(pgrl_from_epoch_us(sqlc.narg(at_us)::bigint), now()) AS ts) AS c
), win AS (
    SELECT pgrl_from_epoch_us(pgrl_window_end_us(clock.now_us, sqlc.arg(window_us)::bigint)) AS expires_at
      FROM clock
)
SELECT pgrl_fixed_window_ensure_partitions(win.expires_at, win.expires_at)::integer AS created FROM win;
