-- The steps and the sliding window's roll and elapsed time as migration
-- 000012 made them, and pgrl_elapsed_us STABLE again, as migration 000005
-- made it.

ALTER FUNCTION pgrl_elapsed_us(timestamptz, timestamptz) STABLE;

CREATE OR REPLACE FUNCTION pgrl_token_bucket_take(tokens float8, updated_at_us bigint, now_us bigint, cost bigint,
                                       capacity float8, refill_per_us float8, penalty boolean, up_to boolean)
RETURNS pgrl_token_bucket_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        CASE WHEN penalty
             THEN greatest(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity,
                                                    refill_per_us)
                           - CASE WHEN up_to THEN least(cost::float8, floor(capacity)) ELSE cost END,
                           0 - capacity)
             WHEN up_to
             THEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  - least(least(cost::float8, floor(capacity)),
                          greatest(floor(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0),
                                                                  capacity, refill_per_us)), 0))
             WHEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost
             THEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  - cost
             ELSE pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
        END,
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

CREATE OR REPLACE FUNCTION pgrl_sliding_window_take(row_start_us bigint, count bigint, prev_count bigint, now_us bigint,
                                         window_us bigint, cost bigint, max_count bigint, penalty boolean,
                                         up_to boolean)
RETURNS pgrl_sliding_window_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        greatest(row_start_us, pgrl_window_start_us(now_us, window_us)),
        CASE WHEN penalty
             THEN least(pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false)::numeric
                        + CASE WHEN up_to THEN least(cost, max_count) ELSE cost END,
                        9223372036854775807)::bigint
             ELSE pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false)
                  + CASE WHEN up_to
                         THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                                  max_count, window_us,
                                  pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)), 0))::bigint
                         WHEN cost <= pgrl_sliding_window_room(
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                                  max_count, window_us,
                                  pgrl_sliding_window_elapsed(row_start_us, now_us, window_us))
                         THEN cost
                         ELSE 0 END
        END,
        pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
        CASE WHEN up_to THEN least(cost, max_count) > 0 ELSE true END
        AND CASE WHEN up_to THEN 1 ELSE cost END <= pgrl_sliding_window_room(
                pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                max_count, window_us,
                pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)),
        CASE WHEN up_to
             THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)), 0))::bigint
             WHEN cost <= pgrl_sliding_window_room(
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed(row_start_us, now_us, window_us))
             THEN cost
             ELSE 0 END
    )::pgrl_sliding_window_step
$$;

CREATE OR REPLACE FUNCTION pgrl_sliding_window_roll(row_start_us bigint, now_us bigint, window_us bigint,
                                                    count bigint,
                                         prev_count bigint, previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN row_start_us >= pgrl_window_start_us(now_us, window_us)
                THEN CASE WHEN previous THEN prev_count ELSE count END
                WHEN previous AND row_start_us = pgrl_window_start_us(now_us, window_us) - window_us THEN count
                ELSE 0 END
$$;

CREATE OR REPLACE FUNCTION pgrl_sliding_window_elapsed(row_start_us bigint, now_us bigint, window_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(greatest(now_us - greatest(row_start_us, pgrl_window_start_us(now_us, window_us)), 0), window_us)
$$;

DROP FUNCTION pgrl_sliding_window_take_at(bigint, bigint, bigint, bigint, bigint, bigint, bigint, bigint, boolean,
                                          boolean);
DROP FUNCTION pgrl_sliding_window_elapsed_at(bigint, bigint, bigint, bigint);
DROP FUNCTION pgrl_sliding_window_roll_at(bigint, bigint, bigint, bigint, bigint, boolean);
