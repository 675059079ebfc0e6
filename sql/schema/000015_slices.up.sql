-- Slices: the partial grant a lease takes (package lease, ratelimit.Slice),
-- sized by the statement that grants it.
--
-- A lease answers a key's checks in memory from a slice of the key's quota
-- counted here ahead of use. Only the row knows what is left when the slice
-- is taken, so the row decides its size: a slice asks for up to n units, is
-- granted a fair share of what is left, ceil(left / share) (share being
-- about how many processes split the rest), never more than n, never fewer
-- than min (what the check that asked for it needs), and is denied when
-- fewer than min are left. So slices shrink as the key nears its limit, and
-- the last units go one at a time. Under penalty a denied slice charges
-- min, the attempt of the check that asked, never the ask.
--
-- A slice is decided by composing its algorithm's step (migration 000012):
-- a partial grant of n * share units (the probe) reads what is left, the
-- ask follows from it, and a partial grant of the ask decides. Nothing here
-- computes what a step computes.
--
-- Slices are checks of the check functions of migration 000014, which gain
-- two arguments: per check, mins (min) and shares (share; 0 for any other
-- check, whose cost is then a cost, or with up_to a ceiling, as before); a
-- slice's cost is its n. A slice is always a lone check, never in a group.
-- The functions of migration 000014 stay, for the statements of earlier
-- versions of pgrl; the token bucket's has no slices.

-- pgrl_slice_probe is the probe's ask: n * share, at most the largest
-- bigint.
CREATE FUNCTION pgrl_slice_probe(n bigint, share bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(n::numeric * share, 9223372036854775807)::bigint $$;

-- pgrl_slice_ask is a slice's ask, given left (what the probe was granted:
-- the units left, at most n * share): ceil(left / share), at least min and
-- at most n.
CREATE FUNCTION pgrl_slice_ask(left_units bigint, n bigint, min bigint, share bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(n, greatest(min, ceil(left_units::numeric / share)::bigint)) $$;

CREATE FUNCTION pgrl_fixed_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    mins bigint[], shares bigint[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, count bigint, allowed boolean,
               expires_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    end_us  bigint[];
    cnt     bigint[];
    last    boolean[];
    counts  bigint[];
    verdict boolean[];
    gave    bigint[];
    c       bigint;
    r       integer;
    first   integer := 1;
    ok      boolean;
    s       pgrl_fixed_window_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        IF k > 1 AND keys[k] <= keys[k - 1] THEN
            RAISE EXCEPTION 'pgrl: rows % and % of a check statement are not in ascending key order', k - 1, k
                USING ERRCODE = 'invalid_parameter_value', HINT = 'give each key once, sorted by its bytes';
        END IF;
        end_us[k] := pgrl_window_end_us(now_at, windows_us[k]);
        SELECT t.count INTO c
          FROM pgrl_fixed_window AS t
         WHERE t.key = keys[k] AND t.expires_at = pgrl_from_epoch_us(end_us[k])
           FOR UPDATE;
        IF NOT FOUND THEN
            -- A new window: make the row (a concurrent statement may have
            -- just made it: then this locks it and reads its count).
            INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
            VALUES (keys[k], pgrl_from_epoch_us(end_us[k]), 0, true, ts)
            ON CONFLICT (key, expires_at) DO UPDATE SET count = t.count
            RETURNING t.count INTO c;
        END IF;
        cnt[k] := c;
    END LOOP;
    FOR g IN 1 .. coalesce(array_length(runs, 1), 0) LOOP
        r := runs[g];
        IF r > 0 THEN
            -- One row's checks, each applied.
            c := cnt[r];
            FOR i IN first .. ends[g] LOOP
                IF shares[i] > 0 THEN
                    -- A slice: a probe reads what is left, the fair share of it is asked, and too
                    -- little left is a denial of mins[i].
                    s := pgrl_fixed_window_take(end_us[r], c, pgrl_slice_probe(costs[i], shares[i]), max_counts[r],
                                                false, true);
                    s := pgrl_fixed_window_take(end_us[r], c, pgrl_slice_ask(s.granted, costs[i], mins[i], shares[i]),
                                                max_counts[r], false, true);
                    IF s.granted < mins[i] THEN
                        s := pgrl_fixed_window_take(end_us[r], c, mins[i], max_counts[r], penalties[r], false);
                    END IF;
                ELSE
                    s := pgrl_fixed_window_take(end_us[r], c, costs[i], max_counts[r], penalties[r], up_to[i]);
                END IF;
                c := s.count;
                check_index := i; granted := s.granted; count := s.count; allowed := s.allowed;
                expires_at_us := end_us[r]; now_us := now_at;
                RETURN NEXT;
            END LOOP;
            cnt[r] := c;
            last[r] := s.allowed;
        ELSE
            -- A group: decided, then applied only if every veto allows.
            ok := true;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                s := pgrl_fixed_window_take(end_us[r], cnt[r], costs[j], max_counts[r], penalties[r], up_to[j]);
                counts[j] := s.count; verdict[j] := s.allowed; gave[j] := s.granted;
                ok := ok AND (s.allowed OR NOT vetoes[j]);
            END LOOP;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                IF ok THEN
                    cnt[r] := counts[j];
                    last[r] := verdict[j];
                END IF;
                check_index := j; granted := CASE WHEN ok THEN gave[j] ELSE 0 END; count := counts[j];
                allowed := verdict[j]; expires_at_us := end_us[r]; now_us := now_at;
                RETURN NEXT;
            END LOOP;
        END IF;
        first := ends[g] + 1;
    END LOOP;
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        CONTINUE WHEN last[k] IS NULL;
        c := cnt[k]; ok := last[k];
        UPDATE pgrl_fixed_window AS t
           SET count = c, allowed = ok, updated_at = greatest(t.updated_at, ts)
         WHERE t.key = keys[k] AND t.expires_at = pgrl_from_epoch_us(end_us[k]);
    END LOOP;
END
$$;

CREATE FUNCTION pgrl_sliding_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    mins bigint[], shares bigint[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, window_start_us bigint, count bigint, prev_count bigint,
               allowed boolean, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    ws      bigint[];
    cur     bigint[];
    prev    bigint[];
    last    boolean[];
    wss     bigint[];
    curs    bigint[];
    prevs   bigint[];
    verdict boolean[];
    gave    bigint[];
    starts  bigint;
    expiry  bigint;
    a       bigint;
    b       bigint;
    c       bigint;
    r       integer;
    first   integer := 1;
    ok      boolean;
    s       pgrl_sliding_window_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        IF k > 1 AND keys[k] <= keys[k - 1] THEN
            RAISE EXCEPTION 'pgrl: rows % and % of a check statement are not in ascending key order', k - 1, k
                USING ERRCODE = 'invalid_parameter_value', HINT = 'give each key once, sorted by its bytes';
        END IF;
        starts := pgrl_window_start_us(now_at, windows_us[k]);
        SELECT pgrl_us(t.window_start), t.count, t.prev_count INTO a, b, c
          FROM pgrl_sliding_window AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed,
                                                  updated_at)
            VALUES (keys[k], pgrl_from_epoch_us(starts), 0, 0, pgrl_from_epoch_us(starts + 2 * windows_us[k]),
                    true, ts)
            ON CONFLICT (key) DO UPDATE SET count = t.count
            RETURNING pgrl_us(t.window_start), t.count, t.prev_count INTO a, b, c;
        END IF;
        ws[k] := a; cur[k] := b; prev[k] := c;
    END LOOP;
    FOR g IN 1 .. coalesce(array_length(runs, 1), 0) LOOP
        r := runs[g];
        IF r > 0 THEN
            a := ws[r]; b := cur[r]; c := prev[r];
            FOR i IN first .. ends[g] LOOP
                IF shares[i] > 0 THEN
                    -- A slice, as in pgrl_fixed_window_take_checks.
                    s := pgrl_sliding_window_take(a, b, c, now_at, windows_us[r], pgrl_slice_probe(costs[i], shares[i]),
                                                  max_counts[r], false, true);
                    s := pgrl_sliding_window_take(a, b, c, now_at, windows_us[r],
                                                  pgrl_slice_ask(s.granted, costs[i], mins[i], shares[i]),
                                                  max_counts[r], false, true);
                    IF s.granted < mins[i] THEN
                        s := pgrl_sliding_window_take(a, b, c, now_at, windows_us[r], mins[i], max_counts[r],
                                                      penalties[r], false);
                    END IF;
                ELSE
                    s := pgrl_sliding_window_take(a, b, c, now_at, windows_us[r], costs[i], max_counts[r],
                                                  penalties[r], up_to[i]);
                END IF;
                a := s.window_start_us; b := s.count; c := s.prev_count;
                check_index := i; granted := s.granted; window_start_us := a; count := b; prev_count := c;
                allowed := s.allowed; now_us := now_at;
                RETURN NEXT;
            END LOOP;
            ws[r] := a; cur[r] := b; prev[r] := c;
            last[r] := s.allowed;
        ELSE
            ok := true;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                s := pgrl_sliding_window_take(ws[r], cur[r], prev[r], now_at, windows_us[r], costs[j],
                                              max_counts[r], penalties[r], up_to[j]);
                wss[j] := s.window_start_us; curs[j] := s.count; prevs[j] := s.prev_count;
                verdict[j] := s.allowed; gave[j] := s.granted;
                ok := ok AND (s.allowed OR NOT vetoes[j]);
            END LOOP;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                IF ok THEN
                    ws[r] := wss[j]; cur[r] := curs[j]; prev[r] := prevs[j];
                    last[r] := verdict[j];
                END IF;
                check_index := j; granted := CASE WHEN ok THEN gave[j] ELSE 0 END; window_start_us := wss[j];
                count := curs[j]; prev_count := prevs[j]; allowed := verdict[j]; now_us := now_at;
                RETURN NEXT;
            END LOOP;
        END IF;
        first := ends[g] + 1;
    END LOOP;
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        CONTINUE WHEN last[k] IS NULL;
        a := ws[k]; b := cur[k]; c := prev[k]; expiry := ws[k] + 2 * windows_us[k]; ok := last[k];
        UPDATE pgrl_sliding_window AS t
           SET window_start = pgrl_from_epoch_us(a), count = b, prev_count = c,
               expires_at = pgrl_from_epoch_us(expiry), allowed = ok,
               updated_at = greatest(t.updated_at, ts)
         WHERE t.key = keys[k];
    END LOOP;
END
$$;
