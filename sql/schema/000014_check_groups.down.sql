-- Drops the check functions of migration 000014; the check queues of
-- migration 000006 stay.
DROP FUNCTION pgrl_sliding_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[],
                                              bigint[], boolean[], boolean[], timestamptz);
DROP FUNCTION pgrl_token_bucket_take_checks(bytea[], float8[], float8[], boolean[], integer[], integer[], integer[],
                                            bigint[], boolean[], boolean[], timestamptz);
DROP FUNCTION pgrl_fixed_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[],
                                            bigint[], boolean[], boolean[], timestamptz);
