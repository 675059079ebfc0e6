-- All-or-nothing groups of checks decided inside one statement.
--
-- The check queues of migration 000006 decide a statement's checks key by
-- key, each key's checks one after another. These functions decide runs of
-- checks in the order given: a run is either checks of one row, each
-- applied as its step says (a denied one too, under penalty), exactly as
-- the queues decide them; or a group, checks of several rows that are
-- allowed together or not at all. A group is applied only when every check
-- in it that has a veto allowed (a limit in shadow mode has none);
-- otherwise none of its checks changes a row, not even under penalty, and
-- every later run sees the rows as they were before the group. A login's
-- limits (per email, per IP) thus ride the statement that other requests'
-- checks share, with no second statement to vote, and the decision is one
-- statement on a distributed PostgreSQL too.
--
-- Every row is locked first, in ascending key order (refused otherwise, so
-- that concurrent statements lock rows in one order and never deadlock, and
-- no key is given twice), read once, and written once at the end. Each row
-- comes with its limit's figures; its checks all count against those. Each
-- check is decided by its algorithm's step (migration 000012), as every
-- other statement decides it.
--
-- The final UPDATEs read only scalar variables: Citus 13.2's coordinator
-- crashes (signal 11) on an UPDATE of a distributed table whose SET list
-- reads an element of a PL/pgSQL array, so each row's state is copied out
-- of the arrays first.
--
-- The arguments: keys and the figures, one per row; runs[r] (the row of a
-- run of one row's checks, or 0 for a group) and ends[r] (the 1-based
-- position of its last check), one per run; rows (a check's 1-based row),
-- costs, up_to and vetoes, one per check. check_index is the check's
-- position. The queue functions of migration 000006 stay for the
-- statements of earlier versions of pgrl.

CREATE FUNCTION pgrl_fixed_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    at timestamptz)
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
                s := pgrl_fixed_window_take(end_us[r], c, costs[i], max_counts[r], penalties[r], up_to[i]);
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

CREATE FUNCTION pgrl_token_bucket_take_checks(
    keys bytea[], capacities float8[], refills_per_us float8[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, tokens_bits bigint, updated_at_us bigint,
               full_at_us bigint, allowed boolean)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    bal     float8[];
    upd     bigint[];
    last    boolean[];
    bals    float8[];
    upds    bigint[];
    verdict boolean[];
    gave    bigint[];
    b       float8;
    u       bigint;
    cap     float8;
    refill  float8;
    r       integer;
    first   integer := 1;
    ok      boolean;
    s       pgrl_token_bucket_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        IF k > 1 AND keys[k] <= keys[k - 1] THEN
            RAISE EXCEPTION 'pgrl: rows % and % of a check statement are not in ascending key order', k - 1, k
                USING ERRCODE = 'invalid_parameter_value', HINT = 'give each key once, sorted by its bytes';
        END IF;
        SELECT t.tokens, pgrl_us(t.updated_at) INTO b, u
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacities[k], ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING t.tokens, pgrl_us(t.updated_at) INTO b, u;
        END IF;
        bal[k] := b;
        upd[k] := u;
    END LOOP;
    FOR g IN 1 .. coalesce(array_length(runs, 1), 0) LOOP
        r := runs[g];
        IF r > 0 THEN
            b := bal[r];
            u := upd[r];
            FOR i IN first .. ends[g] LOOP
                s := pgrl_token_bucket_take(b, u, now_at, costs[i], capacities[r], refills_per_us[r], penalties[r],
                                            up_to[i]);
                b := s.tokens;
                u := s.updated_at_us;
                check_index := i; granted := s.granted; tokens_bits := pgrl_float8_bits(b); updated_at_us := u;
                full_at_us := pgrl_epoch_us(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, capacities[r],
                                                                      refills_per_us[r]));
                allowed := s.allowed;
                RETURN NEXT;
            END LOOP;
            bal[r] := b;
            upd[r] := u;
            last[r] := s.allowed;
        ELSE
            ok := true;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                s := pgrl_token_bucket_take(bal[r], upd[r], now_at, costs[j], capacities[r], refills_per_us[r],
                                            penalties[r], up_to[j]);
                bals[j] := s.tokens; upds[j] := s.updated_at_us; verdict[j] := s.allowed; gave[j] := s.granted;
                ok := ok AND (s.allowed OR NOT vetoes[j]);
            END LOOP;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                IF ok THEN
                    bal[r] := bals[j];
                    upd[r] := upds[j];
                    last[r] := verdict[j];
                END IF;
                check_index := j; granted := CASE WHEN ok THEN gave[j] ELSE 0 END;
                tokens_bits := pgrl_float8_bits(bals[j]); updated_at_us := upds[j];
                full_at_us := pgrl_epoch_us(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upds[j]), bals[j],
                                                                      capacities[r], refills_per_us[r]));
                allowed := verdict[j];
                RETURN NEXT;
            END LOOP;
        END IF;
        first := ends[g] + 1;
    END LOOP;
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        CONTINUE WHEN last[k] IS NULL;
        b := bal[k]; u := upd[k]; ok := last[k]; cap := capacities[k]; refill := refills_per_us[k];
        UPDATE pgrl_token_bucket AS t
           SET tokens = b, updated_at = pgrl_from_epoch_us(u),
               full_at = pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, cap, refill),
               allowed = ok
         WHERE t.key = keys[k];
    END LOOP;
END
$$;

CREATE FUNCTION pgrl_sliding_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    at timestamptz)
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
                s := pgrl_sliding_window_take(a, b, c, now_at, windows_us[r], costs[i], max_counts[r], penalties[r],
                                              up_to[i]);
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
