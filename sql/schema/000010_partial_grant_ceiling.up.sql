-- A partial grant's ask is a ceiling, not a cost.
--
-- The check-queue functions of migration 000006 took a partial grant (up_to)
-- of more units than the limit holds at once as it came: they granted what
-- was left, but under penalty charged the whole ask, so that one ask of the
-- largest bigint held a key's count at the largest bigint (a sliding window
-- then denies for the next window too) and a bucket at its deepest debt.
-- From this migration on, an ask above the capacity (max_counts[k], or the
-- bucket's capacity) is an ask of the capacity in every respect: it is
-- granted what is left, and under penalty charged the capacity, the most
-- any check can take at once, as an AllowN of the whole capacity would be.
-- The library caps the ask the same way before it sends it, and in its
-- memory tier, so every path agrees whichever migration the database is at.
-- All-or-nothing checks are unchanged. The functions keep their signatures;
-- only their bodies change.

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
