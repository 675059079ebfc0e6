-- Restore the partitioning functions of migration 000002 and drop the ones
-- migration 000004 added. Partitions made meanwhile stay as they are.

DROP FUNCTION IF EXISTS pgrl_fixed_window_set_layout(text, interval, interval);

CREATE OR REPLACE FUNCTION pgrl_fixed_window_ensure_partitions(from_ts timestamptz, to_ts timestamptz)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    parent  regclass := 'pgrl_fixed_window'::regclass;
    nsp     name;
    step    bigint;
    s       bigint;
    last_s  bigint;
    part    text;
    created integer := 0;
BEGIN
    SELECT partition_seconds INTO step
      FROM pgrl_partition_settings WHERE table_name = 'pgrl_fixed_window';
    IF step IS NULL THEN
        RETURN 0;
    END IF;
    IF to_ts < from_ts THEN
        RAISE EXCEPTION 'pgrl: to_ts (%) is before from_ts (%)', to_ts, from_ts;
    END IF;

    SELECT n.nspname INTO nsp
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = parent;

    -- One creator at a time; the others find the partitions made.
    PERFORM pg_advisory_xact_lock(hashtext('pgrl_fixed_window_partitions'));

    s      := floor(extract(epoch FROM from_ts) / step)::bigint * step;
    last_s := floor(extract(epoch FROM to_ts) / step)::bigint * step;
    WHILE s <= last_s LOOP
        part := 'pgrl_fixed_window_' ||
                to_char(to_timestamp(s) AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
        IF NOT EXISTS (
            SELECT 1 FROM pg_class c
             WHERE c.relname = part AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = nsp)
        ) THEN
            EXECUTE format(
                'CREATE UNLOGGED TABLE %I.%I (LIKE %I.pgrl_fixed_window) WITH ('
                'fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02, '
                'autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.05, '
                'autovacuum_vacuum_cost_delay = 0)',
                nsp, part, nsp);
            EXECUTE format(
                'ALTER TABLE %I.pgrl_fixed_window ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                nsp, nsp, part, to_timestamp(s), to_timestamp(s + step));
            created := created + 1;
        END IF;
        s := s + step;
    END LOOP;
    RETURN created;
END
$$;

CREATE OR REPLACE FUNCTION pgrl_fixed_window_set_layout(layout text, partition_width interval DEFAULT interval '1 hour')
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    nsp     name;
    kind    "char";
    step    bigint;
    horizon timestamptz;
BEGIN
    IF layout NOT IN ('plain', 'partitioned') THEN
        RAISE EXCEPTION 'pgrl: unknown layout %; use plain or partitioned', quote_literal(layout)
              USING ERRCODE = '22023';
    END IF;

    SELECT n.nspname, c.relkind INTO nsp, kind
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = 'pgrl_fixed_window'::regclass;

    EXECUTE format('LOCK TABLE %I.pgrl_fixed_window IN ACCESS EXCLUSIVE MODE', nsp);

    IF layout = 'partitioned' THEN
        step := floor(extract(epoch FROM partition_width))::bigint;
        IF step < 1 THEN
            RAISE EXCEPTION 'pgrl: partition width % is shorter than one second', partition_width
                  USING ERRCODE = '22023';
        END IF;
        INSERT INTO pgrl_partition_settings (table_name, partition_seconds)
        VALUES ('pgrl_fixed_window', step)
        ON CONFLICT (table_name) DO UPDATE SET partition_seconds = excluded.partition_seconds;
        IF kind = 'p' THEN
            RETURN 'partitioned';
        END IF;

        EXECUTE format('ALTER TABLE %I.pgrl_fixed_window RENAME TO pgrl_fixed_window_converting', nsp);
        EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_converting RENAME CONSTRAINT pgrl_fixed_window_pkey TO pgrl_fixed_window_converting_pkey', nsp);
        EXECUTE format(
            'CREATE TABLE %I.pgrl_fixed_window ('
            '  key bytea NOT NULL, expires_at timestamptz NOT NULL,'
            '  count bigint NOT NULL, allowed boolean NOT NULL,'
            '  CONSTRAINT pgrl_fixed_window_pkey PRIMARY KEY (key, expires_at)'
            ') PARTITION BY RANGE (expires_at)', nsp);
        EXECUTE format('COMMENT ON TABLE %I.pgrl_fixed_window IS %L', nsp,
            'pgrl fixed-window counters: one row per key per window, partitioned by expires_at');

        EXECUTE format('SELECT max(expires_at) FROM %I.pgrl_fixed_window_converting', nsp) INTO horizon;
        PERFORM pgrl_fixed_window_ensure_partitions(
            statement_timestamp(),
            greatest(coalesce(horizon, statement_timestamp()), statement_timestamp() + interval '1 hour'));
        EXECUTE format(
            'INSERT INTO %I.pgrl_fixed_window (key, expires_at, count, allowed) '
            'SELECT key, expires_at, count, allowed FROM %I.pgrl_fixed_window_converting '
            'WHERE expires_at > statement_timestamp()', nsp, nsp);
        EXECUTE format('DROP TABLE %I.pgrl_fixed_window_converting', nsp);
        RETURN 'partitioned';
    END IF;

    -- layout = 'plain'
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
    EXECUTE format(
        'INSERT INTO %I.pgrl_fixed_window (key, expires_at, count, allowed) '
        'SELECT key, expires_at, count, allowed FROM %I.pgrl_fixed_window_converting '
        'WHERE expires_at > statement_timestamp()', nsp, nsp);
    EXECUTE format('DROP TABLE %I.pgrl_fixed_window_converting', nsp);
    RETURN 'plain';
END
$$;

DROP FUNCTION IF EXISTS pgrl_fixed_window_create_partitions(regclass, timestamptz, timestamptz, integer);
DROP FUNCTION IF EXISTS pgrl_fixed_window_partitions_needed(timestamptz, timestamptz, bigint);
DROP FUNCTION IF EXISTS pgrl_fixed_window_partition_bounds(regclass);
DROP FUNCTION IF EXISTS pgrl_copy_privileges(regclass, regclass);
