-- The return of a lease's unused units (package lease). Slices are taken
-- by the check statements (checks.sql, migration 000015); the fixed
-- window's units go back by gen's FixedWindowTake with a negative cost,
-- pinned to the slice's instant.

-- name: SlidingWindowReturnSlice :execrows
-- SlidingWindowReturnSlice gives back n unused units of a slice counted in
-- the window starting at window_start_us: from the row's count while the
-- row is in that window, from its prev_count once it has moved one window
-- on (there they weigh on the current window's estimate, as units never
-- counted would not), never below 0. A row further on has forgotten them.
-- Only IMMUTABLE functions in SET, as a distributed PostgreSQL requires.
UPDATE pgrl_sliding_window AS t
   SET count = CASE WHEN t.window_start = pgrl_ts(sqlc.arg(window_start_us)::bigint)
                    THEN greatest(t.count - sqlc.arg(n)::bigint, 0) ELSE t.count END,
       prev_count = CASE WHEN t.window_start = pgrl_ts(sqlc.arg(window_start_us)::bigint + sqlc.arg(window_us)::bigint)
                         THEN greatest(t.prev_count - sqlc.arg(n)::bigint, 0) ELSE t.prev_count END
 WHERE t.key = sqlc.arg(key)::bytea
   AND t.window_start IN (pgrl_ts(sqlc.arg(window_start_us)::bigint),
                          pgrl_ts(sqlc.arg(window_start_us)::bigint + sqlc.arg(window_us)::bigint));
