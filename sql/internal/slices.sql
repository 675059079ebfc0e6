-- The statements that take and give back a lease's slices (package lease,
-- through ratelimit.Slice): a partial grant sized by the row, fair to the
-- other holders (migration 000015), and the return of a slice's unused
-- units. The fixed window's return is gen's FixedWindowTake with a negative
-- cost, pinned to the slice's instant.

-- name: FixedWindowTakeSlice :one
SELECT q.granted::bigint AS granted, q.count::bigint AS count, q.allowed::boolean AS allowed,
       q.expires_at_us::bigint AS expires_at_us, q.now_us::bigint AS now_us
  FROM pgrl_fixed_window_take_slice(@key::bytea, @n::bigint, @min::bigint, @share::bigint, @max_count::bigint,
                                    @window_us::bigint, @penalty::boolean, sqlc.narg(at)::timestamptz) AS q;

-- name: SlidingWindowTakeSlice :one
SELECT q.granted::bigint AS granted, q.window_start_us::bigint AS window_start_us, q.count::bigint AS count,
       q.prev_count::bigint AS prev_count, q.allowed::boolean AS allowed, q.now_us::bigint AS now_us
  FROM pgrl_sliding_window_take_slice(@key::bytea, @n::bigint, @min::bigint, @share::bigint, @max_count::bigint,
                                      @window_us::bigint, @penalty::boolean, sqlc.narg(at)::timestamptz) AS q;

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
