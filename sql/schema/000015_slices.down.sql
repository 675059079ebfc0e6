-- Drops the slice functions of migration 000015.
DROP FUNCTION pgrl_sliding_window_take_slice(bytea, bigint, bigint, bigint, bigint, bigint, boolean, timestamptz);
DROP FUNCTION pgrl_fixed_window_take_slice(bytea, bigint, bigint, bigint, bigint, bigint, boolean, timestamptz);
DROP FUNCTION pgrl_slice_ask(bigint, bigint, bigint, bigint);
DROP FUNCTION pgrl_slice_probe(bigint, bigint);
