-- Queries behind rl-cleanup and package cleanup.
--
-- A row is dead when it can no longer change any decision:
--   pgrl_fixed_window    expires_at <= now (its window has ended)
--   pgrl_token_bucket    full_at    <= now (the bucket would be full again)
--   pgrl_sliding_window  expires_at <= now (two windows have passed)
--   pgrl_concurrency     expires_at <= now (every slot of the key has lapsed)
-- "now" is the database clock, statement_timestamp(), unless at_us pins it
-- (tests only; production leaves it nil). A check never writes a dead row: it only
-- touches the current window, whose end lies after its own clock.
--
-- Deletion runs in bounded batches, one statement and one short transaction
-- each: collect the ctids of up to batch_size dead rows, then delete those
-- rows by ctid (a TID scan). Row locks are taken only on dead rows, which no
-- check touches, and nothing is held between batches. The dead predicate is
-- repeated on the DELETE itself: in the partitioned layout the same ctid
-- exists in several partitions, so a ctid alone does not name one row.
--
-- Each batch's scan starts again at the table's head, but it skips the rows
-- earlier batches deleted cheaply, and on tables larger than a quarter of
-- shared_buffers PostgreSQL's synchronized scans start it where the previous
-- scan stopped. Measured on 1,000,000 dead rows (PG 15, 2 cores): 201 batches
-- of 5,000 in 0.65 s, slowest batch 68 ms; a keyset walk in primary-key order
-- took 6.1 s for the same work (random heap reads), so it is not used.
--
-- Instants go in and out as microseconds since the Unix epoch (bigint, the
-- columns and parameters named ..._us), never as timestamptz: in the exec and
-- simple-protocol modes pgx exchanges text, whose form follows the session's
-- DateStyle and TimeZone.

-- name: CleanupTables :one
-- CleanupTables reports which pgrl tables exist in the search_path, whether
-- pgrl_fixed_window is partitioned, its partition width (0 when plain), the
-- schema it lives in, the server's version number, the database clock
-- (microseconds since the Unix epoch) and whether the citus extension exists
-- in the database (Citus refuses DETACH CONCURRENTLY on distributed tables and
-- a ctid-based batch delete across shards).
SELECT (to_regclass('pgrl_fixed_window'::text) IS NOT NULL)::boolean AS fixed_window_exists,
       (to_regclass('pgrl_token_bucket'::text) IS NOT NULL)::boolean AS token_bucket_exists,
       (to_regclass('pgrl_sliding_window'::text) IS NOT NULL)::boolean AS sliding_window_exists,
       (to_regclass('pgrl_partition_settings'::text) IS NOT NULL)::boolean AS partition_settings_exists,
       coalesce((SELECT c.relkind = 'p' FROM pg_catalog.pg_class AS c
                  WHERE c.oid = to_regclass('pgrl_fixed_window'::text)), false)::boolean AS fixed_window_partitioned,
       coalesce((SELECT n.nspname FROM pg_catalog.pg_class AS c
                   JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                  WHERE c.oid = to_regclass('pgrl_fixed_window'::text)), '')::text AS schema_name,
       current_setting('server_version_num')::integer AS server_version_num,
       (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS now_us,
       EXISTS (SELECT 1 FROM pg_catalog.pg_extension AS e WHERE e.extname = 'citus')::boolean AS citus;

-- name: FixedWindowPartitionSeconds :one
-- FixedWindowPartitionSeconds returns the width of pgrl_fixed_window's
-- partitions in seconds, or 0 in the plain layout.
SELECT coalesce((SELECT s.partition_seconds FROM pgrl_partition_settings AS s
                  WHERE s.table_name = 'pgrl_fixed_window'), 0)::bigint AS partition_seconds;

-- name: CleanupTryLock :one
-- CleanupTryLock takes the session-level advisory lock that keeps two
-- cleanups of the same schema from working at once. It returns false at
-- once, without waiting, when another session holds it. The lock is keyed on
-- the schema that holds pgrl_fixed_window, so cleanups of different schemas
-- in one database do not exclude each other.
SELECT pg_try_advisory_lock(
           hashtext('pgrl_cleanup')::bigint << 32
           | (SELECT c.relnamespace::oid::bigint FROM pg_catalog.pg_class AS c
               WHERE c.oid = 'pgrl_fixed_window'::regclass)
       )::boolean AS locked;

-- name: CleanupUnlock :one
-- CleanupUnlock releases the lock taken by CleanupTryLock.
SELECT pg_advisory_unlock(
           hashtext('pgrl_cleanup')::bigint << 32
           | (SELECT c.relnamespace::oid::bigint FROM pg_catalog.pg_class AS c
               WHERE c.oid = 'pgrl_fixed_window'::regclass)
       )::boolean AS unlocked;

-- name: FixedWindowCountExpired :one
-- FixedWindowCountExpired counts the fixed-window rows whose window has ended.
SELECT count(*)::bigint AS expired
  FROM pgrl_fixed_window AS t
 WHERE t.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- name: FixedWindowDeleteExpiredBatch :execrows
-- FixedWindowDeleteExpiredBatch deletes up to batch_size fixed-window rows
-- whose window has ended (a few more in the partitioned layout, where a
-- batch's ctids are matched in every partition, but only ever dead rows). It
-- returns how many it deleted; fewer than batch_size means none are left.
DELETE FROM pgrl_fixed_window AS d
 WHERE d.ctid = ANY (ARRAY(
           SELECT x.ctid FROM pgrl_fixed_window AS x
            WHERE x.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                           statement_timestamp())
            LIMIT sqlc.arg(batch_size)::integer))
   AND d.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- name: TokenBucketCountFull :one
-- TokenBucketCountFull counts the token buckets that are full again.
SELECT count(*)::bigint AS full_buckets
  FROM pgrl_token_bucket AS t
 WHERE t.full_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                             statement_timestamp());

-- name: TokenBucketDeleteFullBatch :execrows
-- TokenBucketDeleteFullBatch deletes up to batch_size token buckets that are
-- full again (a missing bucket reads as full, so the next check sees no
-- difference). It returns how many it deleted; fewer than batch_size means
-- none are left.
DELETE FROM pgrl_token_bucket AS d
 WHERE d.ctid = ANY (ARRAY(
           SELECT x.ctid FROM pgrl_token_bucket AS x
            WHERE x.full_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                        statement_timestamp())
            LIMIT sqlc.arg(batch_size)::integer))
   AND d.full_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                             statement_timestamp());

-- name: SlidingWindowCountExpired :one
-- SlidingWindowCountExpired counts the sliding-window rows older than two
-- windows.
SELECT count(*)::bigint AS expired
  FROM pgrl_sliding_window AS t
 WHERE t.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- name: SlidingWindowDeleteExpiredBatch :execrows
-- SlidingWindowDeleteExpiredBatch deletes up to batch_size sliding-window
-- rows older than two windows (a check would start them afresh anyway). It
-- returns how many it deleted; fewer than batch_size means none are left.
DELETE FROM pgrl_sliding_window AS d
 WHERE d.ctid = ANY (ARRAY(
           SELECT x.ctid FROM pgrl_sliding_window AS x
            WHERE x.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                           statement_timestamp())
            LIMIT sqlc.arg(batch_size)::integer))
   AND d.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- name: ConcurrencyExists :one
-- ConcurrencyExists reports whether pgrl_concurrency exists in the
-- search_path (migration 000019): a schema at an older version has none,
-- and its cleanup leaves the table out.
SELECT (to_regclass('pgrl_concurrency'::text) IS NOT NULL)::boolean AS concurrency_exists;

-- name: ConcurrencyCountExpired :one
-- ConcurrencyCountExpired counts the concurrency rows whose every slot has
-- lapsed. expires_at is the latest lapse of any slot of the row (an acquire
-- and an extension only ever raise it), so a row dead by it holds nothing:
-- deleting it changes no acquire, which would find the same free places in
-- a missing row. A row whose expires_at is still ahead is never dead, even
-- when its slots were all released.
SELECT count(*)::bigint AS expired
  FROM pgrl_concurrency AS t
 WHERE t.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- name: ConcurrencyDeleteExpiredBatch :execrows
-- ConcurrencyDeleteExpiredBatch deletes up to batch_size concurrency rows
-- whose every slot has lapsed. An acquire or an extension that wrote the
-- row meanwhile raised its expires_at: the DELETE, which rechecks it on the
-- row's latest version, then leaves it. It returns how many it deleted;
-- fewer than batch_size means none are left.
DELETE FROM pgrl_concurrency AS d
 WHERE d.ctid = ANY (ARRAY(
           SELECT x.ctid FROM pgrl_concurrency AS x
            WHERE x.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                           statement_timestamp())
            LIMIT sqlc.arg(batch_size)::integer))
   AND d.expires_at <= coalesce(timestamptz 'epoch' + sqlc.narg(at_us)::bigint * interval '1 microsecond',
                                statement_timestamp());

-- On Citus a ctid names a row of one shard only, and Citus refuses a
-- modification whose WHERE uses ctid with a subquery it has to plan on its
-- own. These batches name their rows by primary key instead: Citus runs the
-- inner SELECT (with its LIMIT) first, then sends each shard the DELETE of
-- its own keys. On plain PostgreSQL the ctid batches above stay in use (a TID
-- scan is cheaper than an index probe per row). at_us is required here: Citus
-- refuses a STABLE function (statement_timestamp()) inside coalesce in a
-- modification, and package cleanup always passes its cutoff.

-- name: FixedWindowDeleteExpiredBatchByKey :execrows
-- FixedWindowDeleteExpiredBatchByKey is FixedWindowDeleteExpiredBatch naming
-- rows by primary key (key, expires_at), for Citus.
DELETE FROM pgrl_fixed_window AS d
 WHERE (d.key, d.expires_at) IN (
           SELECT x.key, x.expires_at FROM pgrl_fixed_window AS x
            WHERE x.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond'
            LIMIT sqlc.arg(batch_size)::integer)
   AND d.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond';

-- name: TokenBucketDeleteFullBatchByKey :execrows
-- TokenBucketDeleteFullBatchByKey is TokenBucketDeleteFullBatch naming rows
-- by primary key, for Citus.
DELETE FROM pgrl_token_bucket AS d
 WHERE d.key IN (
           SELECT x.key FROM pgrl_token_bucket AS x
            WHERE x.full_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond'
            LIMIT sqlc.arg(batch_size)::integer)
   AND d.full_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond';

-- name: SlidingWindowDeleteExpiredBatchByKey :execrows
-- SlidingWindowDeleteExpiredBatchByKey is SlidingWindowDeleteExpiredBatch
-- naming rows by primary key, for Citus.
DELETE FROM pgrl_sliding_window AS d
 WHERE d.key IN (
           SELECT x.key FROM pgrl_sliding_window AS x
            WHERE x.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond'
            LIMIT sqlc.arg(batch_size)::integer)
   AND d.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond';

-- name: ConcurrencyDeleteExpiredBatchByKey :execrows
-- ConcurrencyDeleteExpiredBatchByKey is ConcurrencyDeleteExpiredBatch
-- naming rows by primary key, for Citus.
DELETE FROM pgrl_concurrency AS d
 WHERE d.key IN (
           SELECT x.key FROM pgrl_concurrency AS x
            WHERE x.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond'
            LIMIT sqlc.arg(batch_size)::integer)
   AND d.expires_at <= timestamptz 'epoch' + sqlc.arg(at_us)::bigint * interval '1 microsecond';

-- name: FixedWindowPartitions :many
-- FixedWindowPartitions lists the partitions of pgrl_fixed_window, oldest
-- first, with their bounds in microseconds since the Unix epoch, read by
-- pgrl_fixed_window_partition_bounds (lower bound the least bigint for
-- MINVALUE, upper bound the greatest for MAXVALUE and for a DEFAULT
-- partition). past is true when the upper bound is at or before now, on the
-- database clock: such a partition holds only dead rows. rows_estimate is the
-- planner's estimate (-1 or 0 when never analyzed).
SELECT n.nspname::text AS schema_name,
       c.relname::text AS partition_name,
       coalesce((extract(epoch FROM b.lower_bound) * 1000000)::bigint,
                -9223372036854775808)::bigint AS lower_bound_us,
       coalesce((extract(epoch FROM b.upper_bound) * 1000000)::bigint,
                9223372036854775807)::bigint AS upper_bound_us,
       (pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')::boolean AS is_default,
       coalesce(b.upper_bound <= statement_timestamp(), false)::boolean AS past,
       c.reltuples::bigint AS rows_estimate
  FROM pg_catalog.pg_inherits AS i
  JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
  JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
  LEFT JOIN pgrl_fixed_window_partition_bounds('pgrl_fixed_window'::regclass) AS b ON b.partition_name = c.relname
 WHERE i.inhparent = 'pgrl_fixed_window'::regclass
 ORDER BY upper_bound_us, partition_name;

-- name: FixedWindowEnsurePartitionsAhead :one
-- FixedWindowEnsurePartitionsAhead creates, in the partitioned layout, every
-- missing partition from now to now + horizon_us microseconds and returns how
-- many it created (0 in the plain layout).
SELECT pgrl_fixed_window_ensure_partitions(
           statement_timestamp(),
           statement_timestamp() + sqlc.arg(horizon_us)::bigint * interval '1 microsecond'
       )::integer AS created;

-- name: FixedWindowDetachedPartitions :many
-- FixedWindowDetachedPartitions lists tables named like pgrl_fixed_window's
-- partitions (pgrl_fixed_window_YYYYMMDDtHHMMSS) in its schema that are no
-- longer attached to it: what a cleanup interrupted between DETACH and DROP
-- leaves behind. No check can reach them.
SELECT n.nspname::text AS schema_name,
       c.relname::text AS table_name
  FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
 WHERE c.relkind = 'r'
   AND c.relnamespace = (SELECT p.relnamespace FROM pg_catalog.pg_class AS p
                          WHERE p.oid = 'pgrl_fixed_window'::regclass)
   AND c.relname ~ '^pgrl_fixed_window_[0-9]{8}t[0-9]{6}$'
   AND NOT c.relispartition
 ORDER BY c.relname;

-- name: CleanupHorizon :one
-- CleanupHorizon reports what holds back the instant up to which rows are
-- dead. A transaction decides at its start (now()), so a row another
-- transaction of this database can still read must survive until that
-- transaction ends. It returns the database clock, the start of the oldest
-- open transaction it can see in this database (other than its own session)
-- and that session's pid (the clock and 0 when there is none; instants in
-- microseconds since the Unix epoch), how many sessions of this database have an open
-- transaction whose start it cannot see (sessions of other roles, without
-- pg_read_all_stats: pg_stat_activity hides their xact_start, while pg_locks
-- still shows each transaction's lock on its own virtual transaction id), and
-- when the oldest prepared transaction of this database was prepared (the
-- clock when there is none).
WITH sessions AS (
    SELECT a.pid,
           a.xact_start,
           (a.query = '<insufficient privilege>' AND a.backend_type IS NULL) AS hidden
      FROM pg_catalog.pg_stat_activity AS a
     WHERE a.datid = (SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname = current_database())
       AND a.usesysid IS NOT NULL
       AND a.pid <> pg_backend_pid()
)
SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS now_us,
       (extract(epoch FROM coalesce((SELECT min(s.xact_start) FROM sessions AS s WHERE NOT s.hidden),
                                    statement_timestamp())) * 1000000)::bigint AS oldest_xact_start_us,
       coalesce((SELECT s.pid FROM sessions AS s
                  WHERE NOT s.hidden AND s.xact_start IS NOT NULL
                  ORDER BY s.xact_start LIMIT 1), 0)::integer AS oldest_pid,
       (SELECT count(*) FROM sessions AS s
         WHERE s.hidden
           AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks AS l
                        WHERE l.pid = s.pid AND l.locktype = 'virtualxid' AND l.granted))::bigint AS hidden_open,
       (extract(epoch FROM coalesce((SELECT min(p.prepared) FROM pg_catalog.pg_prepared_xacts AS p
                                     WHERE p.database = current_database()),
                                    statement_timestamp())) * 1000000)::bigint AS oldest_prepared_us;

-- name: CleanupPrivileges :one
-- CleanupPrivileges reports what the current role may do to pgrl's tables,
-- so that a missing grant is named before anything is tried. (A schema
-- without USAGE hides the tables: RunConn asks internal/pgerr about it.)
-- The can_* columns are true when the table is absent (nothing to check).
-- can_clean_concurrency is false for a role granted the counter tables only
-- (before migration 000019 added pgrl_concurrency): the run then leaves that
-- table alone and warns.
-- fixed_window_owner names the role owning pgrl_fixed_window and owns_fixed_window
-- says whether the current role is it or a member of it (partition mode
-- creates, detaches and drops partitions, which only the owner may do).
SELECT current_user::text AS role_name,
       coalesce(has_table_privilege(to_regclass('pgrl_fixed_window'::text), 'SELECT')
                AND has_table_privilege(to_regclass('pgrl_fixed_window'::text), 'DELETE'), true)::boolean
           AS can_clean_fixed_window,
       coalesce(has_table_privilege(to_regclass('pgrl_token_bucket'::text), 'SELECT')
                AND has_table_privilege(to_regclass('pgrl_token_bucket'::text), 'DELETE'), true)::boolean
           AS can_clean_token_bucket,
       coalesce(has_table_privilege(to_regclass('pgrl_sliding_window'::text), 'SELECT')
                AND has_table_privilege(to_regclass('pgrl_sliding_window'::text), 'DELETE'), true)::boolean
           AS can_clean_sliding_window,
       coalesce(has_table_privilege(to_regclass('pgrl_concurrency'::text), 'SELECT')
                AND has_table_privilege(to_regclass('pgrl_concurrency'::text), 'DELETE'), true)::boolean
           AS can_clean_concurrency,
       coalesce(has_table_privilege(to_regclass('pgrl_partition_settings'::text), 'SELECT'), true)::boolean
           AS can_read_partition_settings,
       coalesce((SELECT pg_get_userbyid(c.relowner) FROM pg_catalog.pg_class AS c
                  WHERE c.oid = to_regclass('pgrl_fixed_window'::text)), '')::text AS fixed_window_owner,
       coalesce((SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_catalog.pg_class AS c
                  WHERE c.oid = to_regclass('pgrl_fixed_window'::text)), true)::boolean AS owns_fixed_window;
