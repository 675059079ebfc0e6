-- Check queues: many checks of one key decided by one row update.
--
-- One INSERT … ON CONFLICT DO UPDATE cannot touch a row twice, so before
-- this migration the checks of a hot key (a global ceiling, one big
-- tenant's API key, an attacked login) went to PostgreSQL one statement
-- each, queueing on the row lock. The functions below take, for each key,
-- its checks in arrival order, lock the key's row once, decide the checks
-- one after another exactly as that many single-check statements at the
-- same instant would, write the row once, and return one row per check:
-- the key's state right after that check, shaped as the single-check
-- statement returns it, so that the library builds every caller's Decision
-- with the code it uses for a lone check.
--
-- A check either asks for all of its cost or nothing (up_to false), or is a
-- partial grant (up_to true): it takes as many of its cost units as are
-- left, possibly none, and reports that number as granted. Under penalty a
-- partial grant is charged its whole cost, as any denied unit is.
--
-- Arguments, shared by the three functions:
--   keys    the stored keys, distinct, in the order their rows are locked
--           (sorted, so that two queues never deadlock, nor a queue and a
--           batch of single checks, which lock in key order too);
--   costs   every check's cost, key after key, each key's in arrival order;
--   up_to   whether each check is a partial grant;
--   ends    for each key, the position in costs of its last check (1-based,
--           ascending): key i's checks are costs[ends[i-1]+1 .. ends[i]];
--   the limit's figures, one per key (max_counts, windows_us and penalties;
--           for the token bucket capacities, refills_per_us and
--           penalties): keys of several limiters, with different limits
--           and windows, share one statement;
--   at      pins the clock for tests; NULL takes now().
-- check_index in the result is the check's position in costs.
--
-- These are PL/pgSQL (they loop), so they are called, not inlined; they call
-- the inlinable helpers of migration 000005, whose arithmetic they share
-- with the single-check statements. They resolve pgrl's tables through the
-- caller's search_path, as the statements in gen do, and run with the
-- caller's rights (not SECURITY DEFINER): the application role needs
-- EXECUTE on them, which rl-migrate's --grant-to gives.

CREATE FUNCTION pgrl_fixed_window_take_queue(
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
            n := costs[i];
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

CREATE FUNCTION pgrl_token_bucket_take_queue(
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
            n := costs[i];
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

CREATE FUNCTION pgrl_sliding_window_take_queue(
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
            n := costs[i];
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
