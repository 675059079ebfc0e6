-- Restores the check-queue functions as migration 000010 made them and
-- pgrl_fixed_window_set_layout as migrations 000004 and 000011 made it, then
-- drops the steps, their types, the IMMUTABLE instant functions and the
-- updated_at columns of the two windows.

CREATE OR REPLACE FUNCTION pgrl_fixed_window_take_queue(
    keys bytea[], costs bigint[], up_to boolean[], ends integer[],
    max_counts bigint[], windows_us bigint[], penalties boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, count bigint, allowed boolean,
               expires_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    end_us  bigint;
    ends_at timestamptz;
    n       bigint;
    got     bigint;
    first   integer := 1;
    cnt     bigint;
    ok      boolean;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        end_us := pgrl_window_end_us(now_at, windows_us[k]);
        ends_at := pgrl_from_epoch_us(end_us);
        SELECT t.count INTO cnt
          FROM pgrl_fixed_window AS t
         WHERE t.key = keys[k] AND t.expires_at = ends_at
           FOR UPDATE;
        IF NOT FOUND THEN
            -- A new window: make the row (a concurrent queue may have just
            -- made it: then this locks it and reads its count).
            INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed)
            VALUES (keys[k], ends_at, 0, true)
            ON CONFLICT (key, expires_at) DO UPDATE SET count = t.count
            RETURNING t.count INTO cnt;
        END IF;
        FOR i IN first .. ends[k] LOOP
            n := CASE WHEN up_to[i] THEN least(costs[i], max_counts[k]) ELSE costs[i] END;
            IF up_to[i] THEN
                got := least(n, greatest(max_counts[k] - cnt, 0));
                ok := got > 0;
            ELSE
                ok := cnt <= max_counts[k] - n;
                got := CASE WHEN ok THEN n ELSE 0 END;
            END IF;
            IF penalties[k] THEN
                cnt := pgrl_saturating_add(cnt, n);
            ELSE
                cnt := cnt + got;
            END IF;
            check_index := i; granted := got; count := cnt; allowed := ok;
            expires_at_us := end_us; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_fixed_window AS t SET count = cnt, allowed = ok
         WHERE t.key = keys[k] AND t.expires_at = ends_at;
        first := ends[k] + 1;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION pgrl_token_bucket_take_queue(
    keys bytea[], costs bigint[], up_to boolean[], ends integer[],
    capacities float8[], refills_per_us float8[], penalties boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, tokens_bits bigint, updated_at_us bigint,
               full_at_us bigint, allowed boolean)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts            timestamptz := coalesce(at, now());
    capacity      float8;
    refill_per_us float8;
    n     bigint;
    got   bigint;
    first integer := 1;
    bal   float8;
    upd   timestamptz;
    refilled_at timestamptz;
    ok    boolean;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        capacity := capacities[k];
        refill_per_us := refills_per_us[k];
        SELECT pgrl_token_bucket_refill(t.tokens, pgrl_elapsed_us(t.updated_at, ts), capacity, refill_per_us),
               greatest(t.updated_at, ts)
          INTO bal, upd
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacity, ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING pgrl_token_bucket_refill(t.tokens, pgrl_elapsed_us(t.updated_at, ts), capacity, refill_per_us),
                      greatest(t.updated_at, ts)
                 INTO bal, upd;
        END IF;
        FOR i IN first .. ends[k] LOOP
            n := CASE WHEN up_to[i] AND costs[i] > capacity THEN floor(capacity)::bigint ELSE costs[i] END;
            IF up_to[i] THEN
                got := least(n, floor(greatest(bal, 0))::bigint);
                ok := got > 0;
            ELSE
                ok := bal >= n;
                got := CASE WHEN ok THEN n ELSE 0 END;
            END IF;
            IF penalties[k] THEN
                bal := greatest(bal - n, 0 - capacity);
            ELSE
                bal := bal - got;
            END IF;
            refilled_at := pgrl_token_bucket_full_at(upd, bal, capacity, refill_per_us);
            check_index := i; granted := got; tokens_bits := pgrl_float8_bits(bal);
            updated_at_us := pgrl_epoch_us(upd); full_at_us := pgrl_epoch_us(refilled_at); allowed := ok;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_token_bucket AS t SET tokens = bal, updated_at = upd, full_at = refilled_at, allowed = ok
         WHERE t.key = keys[k];
        first := ends[k] + 1;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION pgrl_sliding_window_take_queue(
    keys bytea[], costs bigint[], up_to boolean[], ends integer[],
    max_counts bigint[], windows_us bigint[], penalties boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, window_start_us bigint, count bigint, prev_count bigint,
               allowed boolean, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    now_at    bigint := pgrl_epoch_us(coalesce(at, now()));
    starts    timestamptz;
    window_us bigint;
    max_count bigint;
    n         bigint;
    got    bigint;
    first  integer := 1;
    ws     timestamptz;
    cur    bigint;
    prev   bigint;
    el     bigint;
    ok     boolean;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        window_us := windows_us[k];
        max_count := max_counts[k];
        starts := pgrl_from_epoch_us(pgrl_window_start_us(now_at, window_us));
        SELECT greatest(t.window_start, starts),
               pgrl_sliding_window_current(t.window_start, starts, t.count),
               pgrl_sliding_window_previous(t.window_start, starts, window_us, t.count, t.prev_count)
          INTO ws, cur, prev
          FROM pgrl_sliding_window AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed)
            VALUES (keys[k], starts, 0, 0, starts + 2 * window_us * interval '1 microsecond', true)
            ON CONFLICT (key) DO UPDATE SET count = t.count
            RETURNING greatest(t.window_start, starts),
                      pgrl_sliding_window_current(t.window_start, starts, t.count),
                      pgrl_sliding_window_previous(t.window_start, starts, window_us, t.count, t.prev_count)
                 INTO ws, cur, prev;
        END IF;
        el := pgrl_sliding_window_elapsed_us(now_at, ws, window_us);
        FOR i IN first .. ends[k] LOOP
            n := CASE WHEN up_to[i] THEN least(costs[i], max_count) ELSE costs[i] END;
            IF up_to[i] THEN
                -- The most units u for which the estimate still fits:
                -- previous * (window - elapsed) / window + current + u <= max.
                got := least(n::numeric, greatest(
                           floor((max_count::numeric * window_us - prev::numeric * (window_us - el)) / window_us)
                           - cur, 0))::bigint;
                ok := got > 0;
            ELSE
                ok := pgrl_sliding_window_allows(prev, cur, n, max_count, window_us, el);
                got := CASE WHEN ok THEN n ELSE 0 END;
            END IF;
            IF penalties[k] THEN
                cur := pgrl_saturating_add(cur, n);
            ELSE
                cur := cur + got;
            END IF;
            check_index := i; granted := got; window_start_us := pgrl_epoch_us(ws); count := cur;
            prev_count := prev; allowed := ok; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_sliding_window AS t
           SET window_start = ws, count = cur, prev_count = prev,
               expires_at = ws + 2 * window_us * interval '1 microsecond', allowed = ok
         WHERE t.key = keys[k];
        first := ends[k] + 1;
    END LOOP;
END
$$;

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
                         FROM pgrl_fixed_window_partition_bounds(
                                  format('%I.pgrl_fixed_window_next', nsp)::regclass) AS b) THEN
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
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window '
                   'RENAME CONSTRAINT pgrl_fixed_window_next_pkey TO pgrl_fixed_window_pkey', nsp);
    RETURN 'partitioned';
END
$$;

DROP FUNCTION pgrl_sliding_window_take(bigint, bigint, bigint, bigint, bigint, bigint, bigint, boolean, boolean);
DROP FUNCTION pgrl_sliding_window_room(bigint, bigint, bigint, bigint, bigint);
DROP FUNCTION pgrl_sliding_window_elapsed(bigint, bigint, bigint);
DROP FUNCTION pgrl_sliding_window_roll(bigint, bigint, bigint, bigint, bigint, boolean);
DROP TYPE pgrl_sliding_window_step;
DROP FUNCTION pgrl_token_bucket_take(float8, bigint, bigint, bigint, float8, float8, boolean, boolean);
DROP TYPE pgrl_token_bucket_step;
DROP FUNCTION pgrl_fixed_window_take(bigint, bigint, bigint, bigint, boolean, boolean);
DROP TYPE pgrl_fixed_window_step;
DROP FUNCTION pgrl_now_us(timestamptz);
DROP FUNCTION pgrl_now(timestamptz);
DROP FUNCTION pgrl_token_bucket_refilled_at(timestamptz, float8, float8, float8);
DROP FUNCTION pgrl_ts(bigint);
DROP FUNCTION pgrl_us(timestamptz);

ALTER TABLE pgrl_sliding_window DROP COLUMN updated_at;
ALTER TABLE pgrl_fixed_window DROP COLUMN updated_at;
