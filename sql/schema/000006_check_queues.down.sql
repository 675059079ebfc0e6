-- Drops the check-queue functions of 000006. A library of the release that
-- added them calls them for coalesced checks of one key and for partial
-- grants: roll the application back first, then migrate down.
DROP FUNCTION IF EXISTS pgrl_fixed_window_take_queue(
    bytea[], bigint[], boolean[], integer[], bigint[], bigint[], boolean[], timestamptz);
DROP FUNCTION IF EXISTS pgrl_token_bucket_take_queue(
    bytea[], bigint[], boolean[], integer[], float8[], float8[], boolean[], timestamptz);
DROP FUNCTION IF EXISTS pgrl_sliding_window_take_queue(
    bytea[], bigint[], boolean[], integer[], bigint[], bigint[], boolean[], timestamptz);
