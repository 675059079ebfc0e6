-- Drops the slice functions of migration 000015; the check functions of
-- migration 000014 stay.
DROP FUNCTION pgrl_sliding_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[],
                                              bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz);
DROP FUNCTION pgrl_fixed_window_take_checks(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[],
                                            bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz);
DROP FUNCTION pgrl_slice_ask(bigint, bigint, bigint, bigint);
DROP FUNCTION pgrl_slice_probe(bigint, bigint);
