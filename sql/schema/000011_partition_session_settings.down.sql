-- The partition functions run with the caller's DateStyle, TimeZone and
-- IntervalStyle again.

ALTER FUNCTION pgrl_fixed_window_partition_bounds(regclass)
    RESET DateStyle RESET TimeZone RESET IntervalStyle;
ALTER FUNCTION pgrl_fixed_window_create_partitions(regclass, timestamptz, timestamptz, integer)
    RESET DateStyle RESET TimeZone RESET IntervalStyle;
ALTER FUNCTION pgrl_fixed_window_set_layout(text, interval, interval)
    RESET DateStyle RESET TimeZone RESET IntervalStyle;
