-- Named arithmetic for the algorithm queries.
--
-- The queries in sql/queries used to spell the same expressions out again and
-- again (the refilled token balance ten times in two statements, the sliding
-- window's previous count five times). These functions name each expression
-- once. Each is a LANGUAGE sql function whose body is one SELECT of one
-- expression, so PostgreSQL inlines it into the calling query at plan time:
-- no function call happens, and the plan is the one the spelled-out SQL had.
-- Inlining needs all of the following, which every function here keeps:
--   - LANGUAGE sql, a body that is a single SELECT of a single expression,
--     no FROM, no sub-SELECT, no aggregate, not returning a set;
--   - not SECURITY DEFINER and no SET clause (so no SET search_path: the
--     body resolves through the caller's search_path, and uses only
--     pg_catalog's operators and functions, which come first on it);
--   - not STRICT (a STRICT function inlines only when its body is strict
--     too, which CASE, coalesce, greatest and least are not);
--   - declared no less volatile than its body: IMMUTABLE when the body is
--     plain arithmetic, STABLE when it reads a timestamptz through extract
--     or adds an interval to one (both are STABLE in pg_catalog);
--   - a parameter used more than once in the body gets a cheap argument
--     (a column, a query parameter, a short expression; not a sub-SELECT and
--     nothing volatile). The queries pass columns and parameters there.
-- A test (gen's TestHelpersAreInlined) checks every query's plan and, with
-- track_functions = 'all', that running it calls none of these functions.
--
-- Instants cross between timestamptz and bigint microseconds since the Unix
-- epoch; windows are aligned on multiples of their width since the epoch,
-- floored, so before 1970 too.

-- pgrl_epoch_us is ts as whole microseconds since the Unix epoch.
CREATE FUNCTION pgrl_epoch_us(ts timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT (extract(epoch FROM ts) * 1000000)::bigint $$;

-- pgrl_from_epoch_us is the instant us microseconds after the Unix epoch.
CREATE FUNCTION pgrl_from_epoch_us(us bigint) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT timestamptz 'epoch' + us * interval '1 microsecond' $$;

-- pgrl_elapsed_us is the time from since to until in microseconds, never
-- less than zero: a check that waited on a row lock can see a row written
-- after its own clock, and must not go back in time.
CREATE FUNCTION pgrl_elapsed_us(since timestamptz, until timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT greatest((extract(epoch FROM until - since) * 1000000)::bigint, 0) $$;

-- pgrl_window_start_us is the start of the window of window_us microseconds
-- that holds the instant now_us: the largest multiple of window_us not after
-- now_us (floored, also for negative now_us).
CREATE FUNCTION pgrl_window_start_us(now_us bigint, window_us bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT now_us - ((now_us % window_us) + window_us) % window_us $$;

-- pgrl_window_end_us is the end of that window (exclusive).
CREATE FUNCTION pgrl_window_end_us(now_us bigint, window_us bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT now_us - ((now_us % window_us) + window_us) % window_us + window_us $$;

-- pgrl_float8_bits is the IEEE 754 bit pattern of x as a bigint: a float8
-- that no session setting (extra_float_digits) can round on its way out.
CREATE FUNCTION pgrl_float8_bits(x float8) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT ('x' || encode(float8send(x), 'hex'))::bit(64)::bigint $$;

-- pgrl_token_bucket_refill is a balance of tokens after elapsed_us
-- microseconds of refill at refill_per_us tokens per microsecond, capped at
-- capacity.
CREATE FUNCTION pgrl_token_bucket_refill(tokens float8, elapsed_us bigint, capacity float8, refill_per_us float8)
RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(capacity, tokens + elapsed_us::float8 * refill_per_us) $$;

-- pgrl_token_bucket_balance is the balance after a check of cost on a bucket
-- that held tokens elapsed_us microseconds ago: refilled, then charged cost
-- when the refilled balance covers it or penalty is set, never below
-- -capacity.
CREATE FUNCTION pgrl_token_bucket_balance(tokens float8, elapsed_us bigint, capacity float8, refill_per_us float8,
                                          cost float8, penalty boolean)
RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT greatest(pgrl_token_bucket_refill(tokens, elapsed_us, capacity, refill_per_us)
                    - CASE WHEN pgrl_token_bucket_refill(tokens, elapsed_us, capacity, refill_per_us) >= cost
                                OR penalty
                           THEN cost ELSE 0 END,
                    0 - capacity)
$$;

-- pgrl_token_bucket_full_at is when a bucket holding balance at instant at
-- is full again if nothing spends from it.
CREATE FUNCTION pgrl_token_bucket_full_at(at timestamptz, balance float8, capacity float8, refill_per_us float8)
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT at + ((capacity - balance) / refill_per_us) * interval '1 microsecond' $$;

-- pgrl_sliding_window_current is a row's count for the window that starts
-- at window_start: its count when the row is in that window (or, having
-- waited on the row lock, a later one), else zero.
CREATE FUNCTION pgrl_sliding_window_current(row_start timestamptz, window_start timestamptz, count bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN row_start >= window_start THEN count ELSE 0 END $$;

-- pgrl_sliding_window_previous is a row's count for the window before the
-- one that starts at window_start: its prev_count when the row is in that
-- window, its count when the row is in the window just before, else zero.
CREATE FUNCTION pgrl_sliding_window_previous(row_start timestamptz, window_start timestamptz, window_us bigint,
                                             count bigint, prev_count bigint)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN row_start >= window_start THEN prev_count
                WHEN row_start = window_start - window_us * interval '1 microsecond' THEN count
                ELSE 0 END
$$;

-- pgrl_sliding_window_elapsed_us is how far the instant now_us is into the
-- window that starts at window_start, between 0 and window_us.
CREATE FUNCTION pgrl_sliding_window_elapsed_us(now_us bigint, window_start timestamptz, window_us bigint)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT least(greatest(now_us - pgrl_epoch_us(window_start), 0), window_us) $$;

-- pgrl_sliding_window_allows is whether cost more units fit: whether the
-- weighted estimate
--   previous * (window_us - elapsed_us) / window_us + current
-- plus cost is at most max_count, compared exactly (multiplied out by
-- window_us, in numeric).
CREATE FUNCTION pgrl_sliding_window_allows(previous bigint, current bigint, cost bigint, max_count bigint,
                                           window_us bigint, elapsed_us bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT previous::numeric * (window_us - elapsed_us) + (current::numeric + cost) * window_us
           <= max_count::numeric * window_us
$$;

-- pgrl_saturating_add is a + b, or the largest bigint when that overflows
-- upwards (a penalised count stops there).
CREATE FUNCTION pgrl_saturating_add(a bigint, b bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(a::numeric + b, 9223372036854775807)::bigint $$;
