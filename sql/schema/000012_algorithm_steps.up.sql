-- One step per algorithm.
--
-- Each algorithm's admit-and-charge arithmetic is written here once, as a
-- step from a key's state, a check and a limit to the key's next state, the
-- verdict and the units granted. Every statement in sql/queries and every
-- check-queue loop calls its algorithm's step and decides nothing itself;
-- the Go memory tier (package ratelimit) has the same three steps, and one
-- table of test vectors (ratelimit/testdata/steps.json) is run against both.
--
-- A check either asks for all of its cost or nothing (up_to false), or is a
-- partial grant (up_to true): it takes as many units as are left, at most
-- its cost, and an ask above the capacity is an ask of the capacity in every
-- respect (migration 000010). Under penalty every attempt is charged: a
-- count stops at the largest bigint, a balance at -capacity.
--
-- Everything here is IMMUTABLE, so that a distributed PostgreSQL (Citus),
-- which accepts only IMMUTABLE functions in an upsert's DO UPDATE SET and in
-- RETURNING, runs the statements as they are.
--
-- Each function is LANGUAGE sql with a body of one SELECT of one expression,
-- so the planner inlines it (see migration 000005 for the conditions, which
-- all hold here; gen's TestHelpersAreInlined checks the plans). A step
-- returns a composite; a statement reads its fields as (step).field, and the
-- planner reduces each such read to that field's expression.

-- Instants, IMMUTABLE. pgrl_us, pgrl_ts and pgrl_token_bucket_refilled_at
-- give exactly what pgrl_epoch_us, pgrl_from_epoch_us and
-- pgrl_token_bucket_full_at of migration 000005 give, through timestamp at
-- time zone UTC, whose arithmetic is IMMUTABLE. The statements use them in
-- an upsert's update arm and in RETURNING, where every argument is a column;
-- the STABLE originals stay everywhere else, because the planner runs an
-- IMMUTABLE function whose arguments are all constants at plan time (for a
-- LANGUAGE sql function: plans its body, on every custom plan) instead of
-- inlining it.
CREATE FUNCTION pgrl_us(ts timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (extract(epoch FROM ts AT TIME ZONE 'UTC') * 1000000)::bigint $$;

CREATE FUNCTION pgrl_ts(us bigint) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (timestamp 'epoch' + us * interval '1 microsecond') AT TIME ZONE 'UTC' $$;

CREATE FUNCTION pgrl_token_bucket_refilled_at(at timestamptz, balance float8, capacity float8, refill_per_us float8)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ((at AT TIME ZONE 'UTC') + ((capacity - balance) / refill_per_us) * interval '1 microsecond')
           AT TIME ZONE 'UTC'
$$;

-- pgrl_now is the check's instant: at when the clock is pinned (tests),
-- else now(). pgrl_now_us is the same in microseconds since the Unix epoch.
-- STABLE, as now() is: never run at plan time, always inlined.
CREATE FUNCTION pgrl_now(at timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT coalesce(at, now()) $$;

CREATE FUNCTION pgrl_now_us(at timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT pgrl_epoch_us(coalesce(at, now())) $$;

-- The instant of a key's latest check. The token bucket has always kept it
-- (updated_at); the two windows keep it now too, so that an upsert's update
-- arm reads the check's instant from the proposed row (excluded.updated_at)
-- and RETURNING reads it from the row, where a distributed PostgreSQL allows
-- no now(). NULL in rows written before this migration: greatest() passes
-- over it. pgrl_fixed_window_set_layout is redefined below to carry it.
ALTER TABLE pgrl_fixed_window ADD COLUMN updated_at timestamptz;
ALTER TABLE pgrl_sliding_window ADD COLUMN updated_at timestamptz;

-- The steps. Each is a composite (the key's next state, the verdict and the
-- units granted) computed from the key's state, the check's instant, the
-- check (cost, penalty, up_to) and the limit. A step's body calls only
-- built-in functions and helpers that take the key's state or the instant:
-- the planner evaluates at plan time any function whose arguments are all
-- constants, which for a LANGUAGE sql function means planning its body on
-- every custom plan, so nothing here is ever called with the check and the
-- limit alone. Hence the ask (the cost, capped at the capacity for a
-- partial grant) and the grant (what is left, for a partial grant; the
-- whole ask or nothing otherwise) are spelled in each step, not named.

CREATE TYPE pgrl_fixed_window_step AS (window_end_us bigint, count bigint, allowed boolean, granted bigint);

-- pgrl_fixed_window_take is the fixed window's step: the window ending at
-- window_end_us holds count units (0 for a window not seen yet) and a check
-- asks for cost of max_count. Its window is the check's: a fixed window keeps
-- a row per window, and the caller passes the row of the window the check's
-- instant falls in (pgrl_window_end_us).
CREATE FUNCTION pgrl_fixed_window_take(window_end_us bigint, count bigint, cost bigint, max_count bigint,
                                       penalty boolean, up_to boolean)
RETURNS pgrl_fixed_window_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        window_end_us,
        CASE WHEN penalty
             THEN least(count::numeric + CASE WHEN up_to THEN least(cost, max_count) ELSE cost END,
                        9223372036854775807)::bigint
             WHEN up_to
             THEN count + least(least(cost, max_count), greatest((max_count::numeric - count), 0))::bigint
             WHEN cost <= (max_count::numeric - count) THEN count + cost
             ELSE count END,
        CASE WHEN up_to THEN least(cost, max_count) > 0 AND (max_count::numeric - count) > 0
             ELSE cost <= (max_count::numeric - count) END,
        CASE WHEN up_to
             THEN least(least(cost, max_count), greatest((max_count::numeric - count), 0))::bigint
             WHEN cost <= (max_count::numeric - count) THEN cost
             ELSE 0 END
    )::pgrl_fixed_window_step
$$;

CREATE TYPE pgrl_token_bucket_step AS (tokens float8, updated_at_us bigint, allowed boolean, granted bigint);

-- pgrl_token_bucket_take is the token bucket's step: a bucket that held
-- tokens at updated_at_us, refilled at refill_per_us tokens a microsecond up
-- to capacity until now_us (never backwards: a check that waited on the row
-- lock may come after a later one), and a check of cost. A partial grant
-- takes the refilled balance's whole tokens, at most its ask (its cost, or
-- the capacity's whole tokens when the cost is above it); any other check
-- is allowed when the balance covers its cost. Under penalty the ask is
-- charged whatever is granted, the balance stopping at -capacity. A bucket
-- not seen yet is full at now_us.
CREATE FUNCTION pgrl_token_bucket_take(tokens float8, updated_at_us bigint, now_us bigint, cost bigint,
                                       capacity float8, refill_per_us float8, penalty boolean, up_to boolean)
RETURNS pgrl_token_bucket_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        CASE WHEN penalty
             THEN greatest(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity,
                                                    refill_per_us)
                           - CASE WHEN up_to THEN least(cost::float8, floor(capacity)) ELSE cost END,
                           0 - capacity)
             WHEN up_to
             THEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  - least(least(cost::float8, floor(capacity)),
                          greatest(floor(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0),
                                                                  capacity, refill_per_us)), 0))
             WHEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost
             THEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  - cost
             ELSE pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
        END,
        greatest(updated_at_us, now_us),
        CASE WHEN up_to
             THEN least(cost::float8, floor(capacity)) >= 1
                  AND pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity,
                                               refill_per_us) >= 1
             ELSE pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost END,
        CASE WHEN up_to
             THEN least(least(cost::float8, floor(capacity)),
                        greatest(floor(pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0),
                                                                capacity, refill_per_us)), 0))::bigint
             WHEN pgrl_token_bucket_refill(tokens, greatest(now_us - updated_at_us, 0), capacity, refill_per_us)
                  >= cost
             THEN cost
             ELSE 0 END
    )::pgrl_token_bucket_step
$$;

CREATE TYPE pgrl_sliding_window_step AS (window_start_us bigint, count bigint, prev_count bigint, allowed boolean,
                                         granted bigint);

-- pgrl_sliding_window_roll is a row's count (previous false) or prev_count
-- (previous true) rolled forward to the window of window_us microseconds
-- that holds now_us: unchanged while the row is in that window (or, having
-- waited on the row lock, a later one); the count becomes the previous
-- window's when the row is in the window just before; else both are 0.
CREATE FUNCTION pgrl_sliding_window_roll(row_start_us bigint, now_us bigint, window_us bigint, count bigint,
                                         prev_count bigint, previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN row_start_us >= pgrl_window_start_us(now_us, window_us)
                THEN CASE WHEN previous THEN prev_count ELSE count END
                WHEN previous AND row_start_us = pgrl_window_start_us(now_us, window_us) - window_us THEN count
                ELSE 0 END
$$;

-- pgrl_sliding_window_elapsed is how far now_us is into the window a row of
-- the window starting at row_start_us is rolled forward to, between 0 and
-- window_us.
CREATE FUNCTION pgrl_sliding_window_elapsed(row_start_us bigint, now_us bigint, window_us bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(greatest(now_us - greatest(row_start_us, pgrl_window_start_us(now_us, window_us)), 0), window_us)
$$;

-- pgrl_sliding_window_room is how many more units the weighted estimate
--   previous * (window_us - elapsed) / window_us + current
-- admits at elapsed microseconds into the current window: the largest u
-- with estimate + u <= max_count, that is
--   floor((max_count * window_us - previous * (window_us - elapsed)) / window_us) - current,
-- exact: numeric's / rounds its quotient (to 16 significant digits or so),
-- which can round a quotient just below an integer up to it, so the floor
-- is taken with div(), which truncates, after shifting the dividend by
-- 2^63 windows to make it non-negative (previous is at most 2^63 - 1).
CREATE FUNCTION pgrl_sliding_window_room(previous bigint, current bigint, max_count bigint, window_us bigint,
                                         elapsed bigint)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT div(max_count::numeric * window_us - previous::numeric * (window_us - elapsed)
               + 9223372036854775808 * window_us::numeric, window_us)
           - 9223372036854775808 - current
$$;

-- pgrl_sliding_window_take is the sliding window's step: a row of the
-- window starting at row_start_us (NULL for a key not seen yet) holding
-- count and prev_count, rolled forward to now_us, and a check of cost
-- against max_count per window_us microseconds.
CREATE FUNCTION pgrl_sliding_window_take(row_start_us bigint, count bigint, prev_count bigint, now_us bigint,
                                         window_us bigint, cost bigint, max_count bigint, penalty boolean,
                                         up_to boolean)
RETURNS pgrl_sliding_window_step
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ROW(
        greatest(row_start_us, pgrl_window_start_us(now_us, window_us)),
        CASE WHEN penalty
             THEN least(pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false)::numeric
                        + CASE WHEN up_to THEN least(cost, max_count) ELSE cost END,
                        9223372036854775807)::bigint
             ELSE pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false)
                  + CASE WHEN up_to
                         THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                                  max_count, window_us,
                                  pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)), 0))::bigint
                         WHEN cost <= pgrl_sliding_window_room(
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                                  pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                                  max_count, window_us,
                                  pgrl_sliding_window_elapsed(row_start_us, now_us, window_us))
                         THEN cost
                         ELSE 0 END
        END,
        pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
        CASE WHEN up_to THEN least(cost, max_count) > 0 ELSE true END
        AND CASE WHEN up_to THEN 1 ELSE cost END <= pgrl_sliding_window_room(
                pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                max_count, window_us,
                pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)),
        CASE WHEN up_to
             THEN least(least(cost, max_count), greatest(pgrl_sliding_window_room(
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed(row_start_us, now_us, window_us)), 0))::bigint
             WHEN cost <= pgrl_sliding_window_room(
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, true),
                      pgrl_sliding_window_roll(row_start_us, now_us, window_us, count, prev_count, false),
                      max_count, window_us,
                      pgrl_sliding_window_elapsed(row_start_us, now_us, window_us))
             THEN cost
             ELSE 0 END
    )::pgrl_sliding_window_step
$$;

-- The check queues (migrations 000006 and 000010) decide each check with
-- their algorithm's step, as every statement does; their signatures and
-- results are unchanged. A column's instant is read with pgrl_us, which a
-- distributed PostgreSQL accepts in RETURNING.
CREATE OR REPLACE FUNCTION pgrl_fixed_window_take_queue(
    keys bytea[], costs bigint[], up_to boolean[], ends integer[],
    max_counts bigint[], windows_us bigint[], penalties boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, count bigint, allowed boolean,
               expires_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    end_us  bigint;
    ends_at timestamptz;
    first   integer := 1;
    cnt     bigint;
    s       pgrl_fixed_window_step;
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
            INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
            VALUES (keys[k], ends_at, 0, true, ts)
            ON CONFLICT (key, expires_at) DO UPDATE SET count = t.count
            RETURNING t.count INTO cnt;
        END IF;
        FOR i IN first .. ends[k] LOOP
            s := pgrl_fixed_window_take(end_us, cnt, costs[i], max_counts[k], penalties[k], up_to[i]);
            cnt := s.count;
            check_index := i; granted := s.granted; count := s.count; allowed := s.allowed;
            expires_at_us := end_us; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_fixed_window AS t
           SET count = cnt, allowed = s.allowed, updated_at = greatest(t.updated_at, ts)
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
    ts     timestamptz := coalesce(at, now());
    now_at bigint := pgrl_epoch_us(coalesce(at, now()));
    first  integer := 1;
    bal    float8;
    upd    bigint;
    s      pgrl_token_bucket_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        SELECT t.tokens, pgrl_us(t.updated_at) INTO bal, upd
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacities[k], ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING t.tokens, pgrl_us(t.updated_at) INTO bal, upd;
        END IF;
        FOR i IN first .. ends[k] LOOP
            s := pgrl_token_bucket_take(bal, upd, now_at, costs[i], capacities[k], refills_per_us[k],
                                        penalties[k], up_to[i]);
            bal := s.tokens;
            upd := s.updated_at_us;
            check_index := i; granted := s.granted; tokens_bits := pgrl_float8_bits(bal);
            updated_at_us := upd;
            full_at_us := pgrl_epoch_us(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upd), bal, capacities[k],
                                                                  refills_per_us[k]));
            allowed := s.allowed;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_token_bucket AS t
           SET tokens = bal, updated_at = pgrl_from_epoch_us(upd),
               full_at = pgrl_token_bucket_full_at(pgrl_from_epoch_us(upd), bal, capacities[k], refills_per_us[k]),
               allowed = s.allowed
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
    ts     timestamptz := coalesce(at, now());
    now_at bigint := pgrl_epoch_us(coalesce(at, now()));
    first  integer := 1;
    starts bigint;
    ws     bigint;
    cur    bigint;
    prev   bigint;
    s      pgrl_sliding_window_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        starts := pgrl_window_start_us(now_at, windows_us[k]);
        SELECT pgrl_us(t.window_start), t.count, t.prev_count INTO ws, cur, prev
          FROM pgrl_sliding_window AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed,
                                                  updated_at)
            VALUES (keys[k], pgrl_from_epoch_us(starts), 0, 0, pgrl_from_epoch_us(starts + 2 * windows_us[k]), true, ts)
            ON CONFLICT (key) DO UPDATE SET count = t.count
            RETURNING pgrl_us(t.window_start), t.count, t.prev_count INTO ws, cur, prev;
        END IF;
        FOR i IN first .. ends[k] LOOP
            s := pgrl_sliding_window_take(ws, cur, prev, now_at, windows_us[k], costs[i], max_counts[k],
                                          penalties[k], up_to[i]);
            ws := s.window_start_us; cur := s.count; prev := s.prev_count;
            check_index := i; granted := s.granted; window_start_us := ws; count := cur;
            prev_count := prev; allowed := s.allowed; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_sliding_window AS t
           SET window_start = pgrl_from_epoch_us(ws), count = cur, prev_count = prev,
               expires_at = pgrl_from_epoch_us(ws + 2 * windows_us[k]), allowed = s.allowed,
               updated_at = greatest(t.updated_at, ts)
         WHERE t.key = keys[k];
        first := ends[k] + 1;
    END LOOP;
END
$$;

-- pgrl_fixed_window_set_layout rebuilds pgrl_fixed_window with every column,
-- updated_at included; otherwise as migrations 000004 and 000011 made it.
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
            '  count bigint NOT NULL, allowed boolean NOT NULL, updated_at timestamptz,'
            '  CONSTRAINT pgrl_fixed_window_pkey PRIMARY KEY (key, expires_at)'
            ') WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.02,'
            '  autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.05,'
            '  autovacuum_vacuum_cost_delay = 0)', nsp);
        EXECUTE format('COMMENT ON TABLE %I.pgrl_fixed_window IS %L', nsp,
            'pgrl fixed-window counters: one row per key per window');
        PERFORM pgrl_copy_privileges(format('%I.pgrl_fixed_window_converting', nsp)::regclass,
                                     format('%I.pgrl_fixed_window', nsp)::regclass);
        EXECUTE format(
            'INSERT INTO %I.pgrl_fixed_window (key, expires_at, count, allowed, updated_at) '
            'SELECT key, expires_at, count, allowed, updated_at FROM %I.pgrl_fixed_window_converting '
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
        '  count bigint NOT NULL, allowed boolean NOT NULL, updated_at timestamptz,'
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
        'INSERT INTO %I.pgrl_fixed_window_next (key, expires_at, count, allowed, updated_at) '
        'SELECT key, expires_at, count, allowed, updated_at FROM %I.pgrl_fixed_window '
        'WHERE expires_at > statement_timestamp()', nsp, nsp);
    EXECUTE format('DROP TABLE %I.pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window_next RENAME TO pgrl_fixed_window', nsp);
    EXECUTE format('ALTER TABLE %I.pgrl_fixed_window '
                   'RENAME CONSTRAINT pgrl_fixed_window_next_pkey TO pgrl_fixed_window_pkey', nsp);
    RETURN 'partitioned';
END
$$;
