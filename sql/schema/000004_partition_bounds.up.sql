-- Bounded, schema-scoped partition creation for pgrl_fixed_window.
--
-- 1. No transaction makes more than 64 partitions. A relation is a lock, and
--    the lock table is shared by every database of the server: a switch that
--    made thousands of partitions in one transaction ran out of shared memory
--    and made checks in other databases fail too.
--    pgrl_fixed_window_ensure_partitions makes at most 64 per call (callers
--    call again, each call its own transaction, until it returns fewer), and
--    pgrl_fixed_window_set_layout refuses a width that would need more than
--    64 partitions to cover the live rows and the lookahead.
-- 2. New partitions start where existing ones end, so changing the width of
--    a partitioned table never makes overlapping ranges: after the last old
--    partition, one shorter partition reaches the next multiple of the new
--    width, and the new width applies from there.
-- 3. The advisory lock that serializes partition creation is keyed on the
--    schema (like the cleanup and migration locks), so two installations in
--    two schemas of one database never wait on each other.
-- 4. A switch to the partitioned layout builds the new table and its
--    partitions before it locks the old table; the ACCESS EXCLUSIVE lock is
--    held only while the live rows are copied.
--
-- All functions run with the search_path they were created with, so they
-- act on the schema they belong to whatever the caller's search_path.

-- pgrl_fixed_window_partition_bounds lists the partitions of parent with
-- their range (DEFAULT partitions excluded). The bounds are read back in the
-- same session that printed them, so the session's DateStyle cannot change
-- them.
CREATE FUNCTION pgrl_fixed_window_partition_bounds(parent regclass)
RETURNS TABLE (partition_name name, lower_bound timestamptz, upper_bound timestamptz)
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT c.relname,
           substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''([^'']*)''\)')::timestamptz,
           substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''([^'']*)''\)')::timestamptz
      FROM pg_catalog.pg_inherits AS i
      JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
     WHERE i.inhparent = parent
       AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
$$;

-- pgrl_copy_privileges gives table to_table the owner and the grants of
-- from_table, so that a layout switch, which replaces pgrl_fixed_window by a
-- new table, keeps the application role's rights (GRANT ... TO app) and the
-- owner (the migration role) even when someone else runs the switch.
CREATE FUNCTION pgrl_copy_privileges(from_table regclass, to_table regclass)
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    old_owner oid;
    g         record;
BEGIN
    SELECT relowner INTO old_owner FROM pg_catalog.pg_class WHERE oid = from_table;
    IF old_owner <> (SELECT relowner FROM pg_catalog.pg_class WHERE oid = to_table) THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %I', to_table, pg_catalog.pg_get_userbyid(old_owner));
    END IF;
    FOR g IN
        SELECT a.grantee, a.privilege_type, a.is_grantable
          FROM pg_catalog.pg_class c, LATERAL aclexplode(c.relacl) AS a
         WHERE c.oid = from_table AND a.grantee <> old_owner
    LOOP
        EXECUTE format('GRANT %s ON TABLE %s TO %s%s', g.privilege_type, to_table,
                       CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END,
                       CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;

-- pgrl_fixed_window_partitions_needed is how many partitions of width
-- step_seconds (aligned on multiples of it) cover [from_ts, to_ts].
CREATE FUNCTION pgrl_fixed_window_partitions_needed(from_ts timestamptz, to_ts timestamptz, step_seconds bigint)
RETURNS bigint
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT greatest(0, floor(extract(epoch FROM to_ts) / step_seconds)::bigint
                     - floor(extract(epoch FROM from_ts) / step_seconds)::bigint + 1)
$$;

-- pgrl_fixed_window_create_partitions creates up to max_new missing
-- partitions of parent (pgrl_fixed_window, or the table a layout switch is
-- building) so that their ranges cover [from_ts, to_ts], and returns how many
-- it created. Ranges already covered are skipped; a new partition ends at the
-- next multiple of the width or where an existing partition begins, so
-- ranges never overlap. It does nothing in the plain layout.
CREATE FUNCTION pgrl_fixed_window_create_partitions(parent regclass, from_ts timestamptz, to_ts timestamptz, max_new integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    nsp     name;
    nsp_oid oid;
    step    bigint;
    s       timestamptz;
    e       timestamptz;
    u       timestamptz;
    nxt     timestamptz;
    part    text;
    created integer := 0;
BEGIN
    SELECT partition_seconds INTO step
      FROM pgrl_partition_settings WHERE table_name = 'pgrl_fixed_window';
    IF step IS NULL THEN
        RETURN 0;
    END IF;
    IF to_ts < from_ts THEN
        RAISE EXCEPTION 'pgrl: to_ts (%) is before from_ts (%)', to_ts, from_ts
              USING ERRCODE = '22023';
    END IF;

    SELECT n.nspname, n.oid INTO nsp, nsp_oid
      FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = parent;

    -- One creator per schema at a time; the others find the partitions made.
    PERFORM pg_advisory_xact_lock(hashtext('pgrl_fixed_window_partitions')::bigint << 32 | nsp_oid::bigint);

    s := to_timestamp(floor(extract(epoch FROM from_ts) / step) * step);
    WHILE s <= to_ts AND created < max_new LOOP
        SELECT b.upper_bound INTO u
          FROM pgrl_fixed_window_partition_bounds(parent) AS b
         WHERE b.lower_bound <= s AND b.upper_bound > s;
        IF u IS NOT NULL THEN
            s := u;  -- covered; go on from where that partition ends
            CONTINUE;
        END IF;
        e := to_timestamp((floor(extract(epoch FROM s) / step) + 1) * step);
        SELECT min(b.lower_bound) INTO nxt
          FROM pgrl_fixed_window_partition_bounds(parent) AS b
         WHERE b.lower_bound > s;
        IF nxt IS NOT NULL AND nxt < e THEN
            e := nxt;
        END IF;
        part := 'pgrl_fixed_window_' ||
                to_char(s AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
        EXECUTE format(
            'CREATE UNLOGGED TABLE %I.%I (LIKE %s) WITH ('
            'fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02, '
            'autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.05, '
            'autovacuum_vacuum_cost_delay = 0)',
            nsp, part, parent);
        -- The partition belongs to the table's owner, whoever made it (a
        -- cleanup role that is a member of the owner role, for instance).
        IF (SELECT relowner FROM pg_catalog.pg_class WHERE oid = parent)
           <> (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
            EXECUTE format('ALTER TABLE %I.%I OWNER TO %I', nsp, part,
                           pg_catalog.pg_get_userbyid((SELECT relowner FROM pg_catalog.pg_class WHERE oid = parent)));
        END IF;
        EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
            parent, nsp, part, s, e);
        created := created + 1;
        s := e;
    END LOOP;
    RETURN created;
END
$$;

-- pgrl_fixed_window_ensure_partitions creates missing partitions of
-- pgrl_fixed_window covering [from_ts, to_ts], at most 64 per call, and
-- returns how many it created (0 in the plain layout). A caller that gets 64
-- calls again, in a new transaction, until it gets fewer.
CREATE OR REPLACE FUNCTION pgrl_fixed_window_ensure_partitions(from_ts timestamptz, to_ts timestamptz)
RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN pgrl_fixed_window_create_partitions('pgrl_fixed_window'::regclass, from_ts, to_ts, 64);
END
$$;

-- pgrl_fixed_window_set_layout switches pgrl_fixed_window between the 'plain'
-- and the 'partitioned' layout, copying the live rows, in the caller's
-- transaction, and makes the partitions from now to now + lookahead.
--
-- To partitioned: the new table and its partitions are built first; then the
-- old table is locked (ACCESS EXCLUSIVE) while its live rows are copied and
-- the tables swap names. It refuses (22023) a width that would need more than
-- 64 partitions to cover the live rows and the lookahead. When the table is
-- already partitioned only the width changes (no table lock): existing
-- partitions keep their ranges and new ones start where they end.
-- To plain: the live rows are copied into a new plain table under an ACCESS
-- EXCLUSIVE lock.
CREATE FUNCTION pgrl_fixed_window_set_layout(layout text, partition_width interval, lookahead interval)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    nsp     name;
    kind    "char";
    step    bigint;
    horizon timestamptz;
    needed  bigint;
BEGIN
    IF layout NOT IN ('plain', 'partitioned') THEN
        RAISE EXCEPTION 'pgrl: unknown layout %; use plain or partitioned', quote_literal(layout)
              USING ERRCODE = '22023';
    END IF;
    IF lookahead < interval '0' THEN
        RAISE EXCEPTION 'pgrl: lookahead % is negative', lookahead USING ERRCODE = '22023';
    END IF;

    SELECT n.nspname, c.relkind INTO nsp, kind
      FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = 'pgrl_fixed_window'::regclass;

    IF layout = 'plain' THEN
        EXECUTE format('LOCK TABLE %I.pgrl_fixed_window IN ACCESS EXCLUSIVE MODE', nsp);
        DELETE FROM pgrl_partition_settings WHERE table_name = 'pgrl_fixed_window';
        IF kind <> 'p' THEN
            RETURN 'plain';
        END IF;
        EXECUTE format('ALTER TABLE %I.pgrl_fixed_window RENAME TO pgrl_fixed_window_converting', nsp);
        EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_converting RENAME CONSTRAINT pgrl_fixed_window_pkey TO pgrl_fixed_window_converting_pkey', nsp);
        EXECUTE format(
            'CREATE UNLOGGED TABLE %I.pgrl_fixed_window ('
            '  key bytea NOT NULL, expires_at timestamptz NOT NULL,'
            '  count bigint NOT NULL, allowed boolean NOT NULL,'
            '  CONSTRAINT pgrl_fixed_window_pkey PRIMARY KEY (key, expires_at)'
            ') WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02,'
            '  autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.05,'
            '  autovacuum_vacuum_cost_delay = 0)', nsp);
        EXECUTE format('COMMENT ON TABLE %I.pgrl_fixed_window IS %L', nsp,
            'pgrl fixed-window counters: one row per key per window');
        PERFORM pgrl_copy_privileges(format('%I.pgrl_fixed_window_converting', nsp)::regclass,
                                     format('%I.pgrl_fixed_window', nsp)::regclass);
        EXECUTE format(
            'INSERT INTO %I.pgrl_fixed_window (key, expires_at, count, allowed) '
            'SELECT key, expires_at, count, allowed FROM %I.pgrl_fixed_window_converting '
            'WHERE expires_at > statement_timestamp()', nsp, nsp);
        EXECUTE format('DROP TABLE %I.pgrl_fixed_window_converting', nsp);
        RETURN 'plain';
    END IF;

    -- layout = 'partitioned'
    step := floor(extract(epoch FROM partition_width))::bigint;
    IF step < 1 THEN
        RAISE EXCEPTION 'pgrl: partition width % is shorter than one second', partition_width
              USING ERRCODE = '22023';
    END IF;

    -- In the plain layout the rows already counted need partitions up to
    -- their window's end (partitions hold them already otherwise). Read it
    -- without a lock first; it is read again under the lock below.
    IF kind <> 'p' THEN
        EXECUTE format('SELECT max(expires_at) FROM %I.pgrl_fixed_window', nsp) INTO horizon;
    END IF;
    horizon := greatest(coalesce(horizon, statement_timestamp()), statement_timestamp() + lookahead);
    needed := pgrl_fixed_window_partitions_needed(statement_timestamp(), horizon, step);
    IF needed > 64 THEN
        RAISE EXCEPTION 'pgrl: partitions of % would need % partitions to reach % (the live windows and the lookahead of %); at most 64 are made at once',
              partition_width, needed, horizon, lookahead
              USING ERRCODE = '22023',
                    HINT = format('use a partition width of at least %s seconds, or a shorter lookahead',
                                  ceil(extract(epoch FROM horizon - statement_timestamp()) / 63));
    END IF;

    -- Serialize with partition creation in this schema before touching the
    -- settings (the same lock pgrl_fixed_window_create_partitions takes).
    PERFORM pg_advisory_xact_lock(hashtext('pgrl_fixed_window_partitions')::bigint << 32
                                  | (SELECT oid::bigint FROM pg_catalog.pg_namespace WHERE nspname = nsp));
    INSERT INTO pgrl_partition_settings (table_name, partition_seconds)
    VALUES ('pgrl_fixed_window', step)
    ON CONFLICT (table_name) DO UPDATE SET partition_seconds = excluded.partition_seconds;

    IF kind = 'p' THEN
        PERFORM pgrl_fixed_window_create_partitions('pgrl_fixed_window'::regclass,
                                                    statement_timestamp(), horizon, 64);
        RETURN 'partitioned';
    END IF;

    EXECUTE format(
        'CREATE TABLE %I.pgrl_fixed_window_next ('
        '  key bytea NOT NULL, expires_at timestamptz NOT NULL,'
        '  count bigint NOT NULL, allowed boolean NOT NULL,'
        '  CONSTRAINT pgrl_fixed_window_next_pkey PRIMARY KEY (key, expires_at)'
        ') PARTITION BY RANGE (expires_at)', nsp);
    EXECUTE format('COMMENT ON TABLE %I.pgrl_fixed_window_next IS %L', nsp,
        'pgrl fixed-window counters: one row per key per window, partitioned by expires_at');
    PERFORM pgrl_copy_privileges(format('%I.pgrl_fixed_window', nsp)::regclass,
                                 format('%I.pgrl_fixed_window_next', nsp)::regclass);
    PERFORM pgrl_fixed_window_create_partitions(format('%I.pgrl_fixed_window_next', nsp)::regclass,
                                                statement_timestamp(), horizon, 64);

    -- From here on checks of fixed-window limits wait: copy and swap.
    EXECUTE format('LOCK TABLE %I.pgrl_fixed_window IN ACCESS EXCLUSIVE MODE', nsp);
    EXECUTE format('SELECT max(expires_at) FROM %I.pgrl_fixed_window', nsp) INTO horizon;
    IF horizon IS NOT NULL THEN
        -- A longer window that began while the partitions were made: a few
        -- more partitions at most, or the switch is refused.
        PERFORM pgrl_fixed_window_create_partitions(format('%I.pgrl_fixed_window_next', nsp)::regclass,
                                                    statement_timestamp(), horizon, 8);
        IF horizon >= (SELECT max(b.upper_bound)
                         FROM pgrl_fixed_window_partition_bounds(format('%I.pgrl_fixed_window_next', nsp)::regclass) AS b) THEN
            RAISE EXCEPTION 'pgrl: live windows reach % and need too many partitions of %', horizon, partition_width
                  USING ERRCODE = '22023', HINT = 'use a wider partition width';
        END IF;
    END IF;
    EXECUTE format(
        'INSERT INTO %I.pgrl_fixed_window_next (key, expires_at, count, allowed) '
        'SELECT key, expires_at, count, allowed FROM %I.pgrl_fixed_window '
        'WHERE expires_at > statement_timestamp()', nsp, nsp);
    EXECUTE format('DROP TABLE %I.pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_next RENAME TO pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window RENAME CONSTRAINT pgrl_fixed_window_next_pkey TO pgrl_fixed_window_pkey', nsp);
    RETURN 'partitioned';
END
$$;

-- The two-argument form keeps its meaning (a lookahead of one hour), with the
-- bounds above.
CREATE OR REPLACE FUNCTION pgrl_fixed_window_set_layout(layout text, partition_width interval DEFAULT interval '1 hour')
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN pgrl_fixed_window_set_layout(layout, partition_width, interval '1 hour');
END
$$;
