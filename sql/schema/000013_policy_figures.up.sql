-- The figures a policy statement counted with, kept in the counter row.
--
-- A check that reads its stored policy in the statement (the ...TakePolicy
-- statements of sql/queries) finds the policy's figures in the upsert's
-- insert arm, where it can join pgrl_policy and pgrl_policy_override. The
-- update arm sees only the existing row (t) and the proposed one (excluded):
-- reading the figures there again took a sub-select per check, which cost
-- more than the lookups themselves. So the proposed row carries them, in
-- these columns, and the update arm reads excluded.policy_limit and the
-- rest. They are the figures the row was last counted with by a policy
-- statement, and NULL in rows only ever counted with a limit given by the
-- caller. Nullable columns without a default: adding them rewrites nothing.
ALTER TABLE pgrl_fixed_window ADD COLUMN policy_limit bigint, ADD COLUMN policy_penalty boolean;
ALTER TABLE pgrl_sliding_window ADD COLUMN policy_limit bigint, ADD COLUMN policy_penalty boolean;
ALTER TABLE pgrl_token_bucket ADD COLUMN policy_limit bigint, ADD COLUMN policy_window_us bigint,
                              ADD COLUMN policy_burst bigint, ADD COLUMN policy_penalty boolean;

COMMENT ON COLUMN pgrl_fixed_window.policy_limit IS 'limit of the policy this row was last counted with';
COMMENT ON COLUMN pgrl_fixed_window.policy_penalty IS 'penalty of the policy this row was last counted with';
COMMENT ON COLUMN pgrl_sliding_window.policy_limit IS 'limit of the policy this row was last counted with';
COMMENT ON COLUMN pgrl_sliding_window.policy_penalty IS 'penalty of the policy this row was last counted with';
COMMENT ON COLUMN pgrl_token_bucket.policy_limit IS 'limit of the policy this row was last counted with';
COMMENT ON COLUMN pgrl_token_bucket.policy_window_us IS 'window of that policy, in microseconds';
COMMENT ON COLUMN pgrl_token_bucket.policy_burst IS 'capacity of that policy';
COMMENT ON COLUMN pgrl_token_bucket.policy_penalty IS 'penalty of that policy';

-- pgrl_fixed_window_set_layout rebuilds pgrl_fixed_window LIKE the table it
-- replaces and copies its rows with SELECT *, so that it carries whatever
-- columns the table has (the figures above included) and a migration that
-- adds a column need not redefine it; otherwise as migrations 000004, 000011
-- and 000012 made it.
CREATE OR REPLACE FUNCTION pgrl_fixed_window_set_layout(layout text, partition_width interval, lookahead interval)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET DateStyle TO 'ISO, YMD' SET TimeZone TO 'UTC' SET IntervalStyle TO 'postgres'
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
        EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_converting '
                       'RENAME CONSTRAINT pgrl_fixed_window_pkey TO pgrl_fixed_window_converting_pkey', nsp);
        EXECUTE format(
            'CREATE UNLOGGED TABLE %I.pgrl_fixed_window ('
            '  LIKE %I.pgrl_fixed_window_converting INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS,'
            '  CONSTRAINT pgrl_fixed_window_pkey PRIMARY KEY (key, expires_at)'
            ') WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02,'
            '  autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.05,'
            '  autovacuum_vacuum_cost_delay = 0)', nsp, nsp);
        EXECUTE format('COMMENT ON TABLE %I.pgrl_fixed_window IS %L', nsp,
            'pgrl fixed-window counters: one row per key per window');
        PERFORM pgrl_copy_privileges(format('%I.pgrl_fixed_window_converting', nsp)::regclass,
                                     format('%I.pgrl_fixed_window', nsp)::regclass);
        EXECUTE format(
            'INSERT INTO %I.pgrl_fixed_window SELECT * FROM %I.pgrl_fixed_window_converting '
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
        RAISE EXCEPTION 'pgrl: partitions of % would need % partitions to reach % '
                        '(the live windows and the lookahead of %); at most 64 are made at once',
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
        '  LIKE %I.pgrl_fixed_window INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMMENTS,'
        '  CONSTRAINT pgrl_fixed_window_next_pkey PRIMARY KEY (key, expires_at)'
        ') PARTITION BY RANGE (expires_at)', nsp, nsp);
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
                         FROM pgrl_fixed_window_partition_bounds(
                                  format('%I.pgrl_fixed_window_next', nsp)::regclass) AS b) THEN
            RAISE EXCEPTION 'pgrl: live windows reach % and need too many partitions of %', horizon, partition_width
                  USING ERRCODE = '22023', HINT = 'use a wider partition width';
        END IF;
    END IF;
    EXECUTE format(
        'INSERT INTO %I.pgrl_fixed_window_next SELECT * FROM %I.pgrl_fixed_window '
        'WHERE expires_at > statement_timestamp()', nsp, nsp);
    EXECUTE format('DROP TABLE %I.pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_next RENAME TO pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window '
                   'RENAME CONSTRAINT pgrl_fixed_window_next_pkey TO pgrl_fixed_window_pkey', nsp);
    RETURN 'partitioned';
END
$$;
