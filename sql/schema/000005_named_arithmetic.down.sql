-- Drops the helper functions of 000005. The algorithm queries of the release
-- that added them call them, so a library or binary of that release or later
-- fails every check (SQLSTATE 42883, undefined function) against a schema
-- migrated down to 4. Roll the application back to a release before 000005
-- first, then migrate down: older queries spell the arithmetic out and do not
-- need these functions.
DROP FUNCTION IF EXISTS pgrl_saturating_add(bigint, bigint);
DROP FUNCTION IF EXISTS pgrl_sliding_window_allows(bigint, bigint, bigint, bigint, bigint, bigint);
DROP FUNCTION IF EXISTS pgrl_sliding_window_elapsed_us(bigint, timestamptz, bigint);
DROP FUNCTION IF EXISTS pgrl_sliding_window_previous(timestamptz, timestamptz, bigint, bigint, bigint);
DROP FUNCTION IF EXISTS pgrl_sliding_window_current(timestamptz, timestamptz, bigint);
DROP FUNCTION IF EXISTS pgrl_token_bucket_full_at(timestamptz, float8, float8, float8);
DROP FUNCTION IF EXISTS pgrl_token_bucket_balance(float8, bigint, float8, float8, float8, boolean);
DROP FUNCTION IF EXISTS pgrl_token_bucket_refill(float8, bigint, float8, float8);
DROP FUNCTION IF EXISTS pgrl_float8_bits(float8);
DROP FUNCTION IF EXISTS pgrl_window_end_us(bigint, bigint);
DROP FUNCTION IF EXISTS pgrl_window_start_us(bigint, bigint);
DROP FUNCTION IF EXISTS pgrl_elapsed_us(timestamptz, timestamptz);
DROP FUNCTION IF EXISTS pgrl_from_epoch_us(bigint);
DROP FUNCTION IF EXISTS pgrl_epoch_us(timestamptz);
