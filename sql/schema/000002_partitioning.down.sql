-- Return pgrl_fixed_window to the plain layout (keeping live counters), then
-- remove the partitioning machinery.
SELECT pgrl_fixed_window_set_layout('plain');
DROP FUNCTION IF EXISTS pgrl_fixed_window_set_layout(text, interval);
DROP FUNCTION IF EXISTS pgrl_fixed_window_ensure_partitions(timestamptz, timestamptz);
DROP TABLE IF EXISTS pgrl_partition_settings;
