-- Smaller steps.
--
-- A step is inlined: the planner substitutes each argument for every
-- reference to it, and a statement's generic plan holds the whole expanded
-- expression, which the executor builds again on every execution. The
-- steps of migration 000012 referred to the refilled balance (the token
-- bucket) and to the rolled-forward counts (the sliding window) in every
-- branch of every field, nine times in the token bucket's update arm, each
-- copy with its instant conversions and the capacity less the leased units:
-- a check cost some 50 microseconds more server time than before them.
--
-- Here each step computes the same results (bit for bit: the test vectors
-- of ratelimit/testdata/steps.json pass unchanged) with fewer references:
-- a field is the refilled balance (or the rolled-forward count) less (plus)
-- one charge, a CASE that names the balance only in its conditions, and the
-- branches a statement's constant up_to = false rules out fold away. The
-- token bucket's update arm now names the refilled balance five times (as
-- before migration 000012), the sliding window's names room twice.
--
-- pgrl_elapsed_us becomes IMMUTABLE (its body always was), so that an
-- upsert's update arm may give a step the time since the row's last check
-- as one conversion, (0, elapsed), where two instants cost two (a
-- distributed PostgreSQL accepts only IMMUTABLE functions there). Every use
-- of it takes a column, so the planner never runs it at plan time.

ALTER FUNCTION pgrl_elapsed_us(timestamptz, timestamptz) IMMUTABLE;

-- pgrl_token_bucket_take: as in migration 000012. The balance is the
-- refilled balance less the charge: under penalty the ask, whatever is
-- granted, stopping at -capacity (greatest() passes over the NULL floor
-- otherwise); for a partial grant the whole tokens the balance holds, at
-- most the ask; else the cost when the balance covers it.
CREATE OR REPLACE FUNCTION pgrl_token_bucket_take(tokens float8, updated_at_us bigint, now_us bigint, cost bigint,
                                                  capacity float8, refill_per_us float8, penalty boolean,
                                                  up_to boolean)
RETURNS pgrl_token_bucket_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        greatest(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                 - CASE WHEN penalty THEN CASE WHEN up_to THEN least(cost::float8, floor(capacity)) ELSE cost END
                        WHEN up_to
                        THEN least(least(cost::float8, floor(capacity)),
                                   greatest(floor(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0),
                                                                           capacity, refill_per_us)), 0))
                        WHEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity,
                                                      refill_per_us) >= cost
                        THEN cost
                        ELSE 0 END,
                 CASE WHEN penalty THEN 0 - capacity END),
        greatest(updated_at_us, now_us),
        CASE WHEN up_to
             THEN least(cost::float8, floor(capacity)) >= 1
                  AND pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity,
                                               refill_per_us) >= 1
             ELSE pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost END,
        CASE WHEN up_to
             THEN least(least(cost::float8, floor(capacity)),
                        greatest(floor(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0),
                                                                capacity, refill_per_us)), 0))::bigint
             WHEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost
             THEN cost
             ELSE 0 END
    )::pgrl_token_bucket_step
$$;

-- The sliding window's step needs the start of the check's window
-- (pgrl_window_start_us), which migration 000012's step computed from the
-- instant in every roll and every elapsed time: thirteen times in an update
-- arm, each time from the instant converted again. A statement has that
-- start at hand: it is the window_start of the row it proposes
-- (excluded.window_start). So the arithmetic now takes it as an argument:
-- pgrl_sliding_window_roll_at, pgrl_sliding_window_elapsed_at and the step
-- pgrl_sliding_window_take_at, and the functions of migration 000012 keep
-- their signatures and results and call them with the start computed from
-- the instant (the check queues, check functions and run statements, which
-- hold the instant in a variable, go on calling pgrl_sliding_window_take).
-- A statement whose instant is an expression calls pgrl_sliding_window_take_at
-- itself: through pgrl_sliding_window_take the start would be an expression
-- of more than 10 operators used several times, which the planner does not
-- inline.

-- pgrl_sliding_window_roll_at is a row's count (previous false) or
-- prev_count (previous true) rolled forward to the window of window_us
-- microseconds starting at window_start_us: unchanged while the row is in
-- that window (or, having waited on the row lock, a later one); the count
-- becomes the previous window's when the row is in the window just before;
-- else both are 0 (also for a row not seen yet: row_start_us NULL).
CREATE FUNCTION pgrl_sliding_window_roll_at(row_start_us bigint, window_start_us bigint, window_us bigint,
                                            count bigint, prev_count bigint, previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN row_start_us >= window_start_us
                THEN CASE WHEN previous THEN prev_count ELSE count END
                WHEN previous AND row_start_us = window_start_us - window_us THEN count
                ELSE 0 END
$$;

-- pgrl_sliding_window_elapsed_at is how far now_us is into the window a row
-- of the window starting at row_start_us is rolled forward to (the window
-- starting at window_start_us, or the row's own when it is later), between
-- 0 and window_us.
CREATE FUNCTION pgrl_sliding_window_elapsed_at(row_start_us bigint, now_us bigint, window_start_us bigint,
                                               window_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(greatest(now_us - greatest(row_start_us, window_start_us), 0), window_us) $$;

CREATE OR REPLACE FUNCTION pgrl_sliding_window_roll(row_start_us bigint, now_us bigint, window_us bigint,
                                                    count bigint, prev_count bigint, previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgrl_sliding_window_roll_at(row_start_us, pgrl_window_start_us(now_us, window_us), window_us, count,
                                       prev_count, previous)
$$;

CREATE OR REPLACE FUNCTION pgrl_sliding_window_elapsed(row_start_us bigint, now_us bigint, window_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgrl_sliding_window_elapsed_at(row_start_us, now_us, pgrl_window_start_us(now_us, window_us), window_us)
$$;

-- pgrl_sliding_window_take_at is the sliding window's step, as migration
-- 000012 has it, for a check at now_us in the window starting at
-- window_start_us. The count is the rolled-forward count plus the charge,
-- in numeric and stopping at the largest bigint, which only a penalised
-- count reaches (a granted charge keeps the estimate within max_count).
-- A key not seen yet (row_start_us NULL) holds no counts, so its verdict
-- and counts do not depend on where its window starts or how far into it
-- now_us is: only the window_start_us field does.
CREATE FUNCTION pgrl_sliding_window_take_at(row_start_us bigint, count bigint, prev_count bigint, now_us bigint,
                                            window_start_us bigint, window_us bigint, cost bigint, max_count bigint,
                                            penalty boolean, up_to boolean)
RETURNS pgrl_sliding_window_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        greatest(row_start_us, window_start_us),
        least(pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, false)::numeric
              + CASE WHEN penalty THEN CASE WHEN up_to THEN least(cost, max_count) ELSE cost END
                     WHEN up_to
                     THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                              pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count,
                                                          true),
                              pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count,
                                                          false),
                              max_count, window_us,
                              pgrl_sliding_window_elapsed_at(row_start_us, now_us, window_start_us, window_us)), 0))
                     WHEN cost <= pgrl_sliding_window_room(
                              pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count,
                                                          true),
                              pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count,
                                                          false),
                              max_count, window_us,
                              pgrl_sliding_window_elapsed_at(row_start_us, now_us, window_start_us, window_us))
                     THEN cost
                     ELSE 0 END,
              9223372036854775807)::bigint,
        pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, true),
        CASE WHEN up_to THEN least(cost, max_count) > 0 ELSE true END
        AND CASE WHEN up_to THEN 1 ELSE cost END <= pgrl_sliding_window_room(
                pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, true),
                pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, false),
                max_count, window_us,
                pgrl_sliding_window_elapsed_at(row_start_us, now_us, window_start_us, window_us)),
        CASE WHEN up_to
             THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                      pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed_at(row_start_us, now_us, window_start_us, window_us)), 0))::bigint
             WHEN cost <= pgrl_sliding_window_room(
                      pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll_at(row_start_us, window_start_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed_at(row_start_us, now_us, window_start_us, window_us))
             THEN cost
             ELSE 0 END
    )::pgrl_sliding_window_step
$$;

-- pgrl_sliding_window_take is the step of migration 000012, for a check at
-- now_us: pgrl_sliding_window_take_at in the window that holds now_us.
CREATE OR REPLACE FUNCTION pgrl_sliding_window_take(row_start_us bigint, count bigint, prev_count bigint,
                                                    now_us bigint, window_us bigint, cost bigint, max_count bigint,
                                                    penalty boolean, up_to boolean)
RETURNS pgrl_sliding_window_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgrl_sliding_window_take_at(row_start_us, count, prev_count, now_us,
                                       pgrl_window_start_us(now_us, window_us), window_us, cost, max_count, penalty,
                                       up_to)
$$;
