-- The partition functions exchange instants with PostgreSQL as text: they
-- read each partition's range back from pg_get_expr, and write the range of a
-- new partition into ATTACH PARTITION ... FOR VALUES. Text follows the
-- session's DateStyle and TimeZone, and some of it does not read back as the
-- instant it was printed from: under TimeZone 'Asia/Kolkata' an instant
-- prints as '... IST', which PostgreSQL reads as Israel Standard Time, so a
-- range read back 3.5 hours off and creating partitions failed (a partition
-- of that name already exists). No session setting may change what they do:
-- they now run with the text forms fixed (ISO dates, UTC, the postgres
-- interval style), whatever the caller's session has; their callers' sessions
-- are left as they were.

ALTER FUNCTION pgrl_fixed_window_partition_bounds(regclass)
    SET DateStyle TO 'ISO, YMD' SET TimeZone TO 'UTC' SET IntervalStyle TO 'postgres';
ALTER FUNCTION pgrl_fixed_window_create_partitions(regclass, timestamptz, timestamptz, integer)
    SET DateStyle TO 'ISO, YMD' SET TimeZone TO 'UTC' SET IntervalStyle TO 'postgres';
ALTER FUNCTION pgrl_fixed_window_set_layout(text, interval, interval)
    SET DateStyle TO 'ISO, YMD' SET TimeZone TO 'UTC' SET IntervalStyle TO 'postgres';
