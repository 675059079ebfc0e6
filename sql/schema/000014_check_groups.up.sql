-- Checks decided in arrival order, and all-or-nothing groups in the same
-- statement.
--
-- The check queues of migration 000006 decide a statement's checks key by
-- key. These functions decide them in the order given, each against its
-- row, so that several checks can be one decision: the checks that share a
-- group number (consecutive in the order given; 0 is no group) are allowed
-- together or not at all. A group is applied only when every check in it
-- that has a veto allowed; otherwise none of its checks changes a row (not
-- even under penalty), and every later check sees the rows as they were
-- before the group. A check in no group is applied as its step says (a
-- denied one too, under penalty). A login's limits (per email, per IP) thus ride the
-- statement that other requests' checks share, with no second statement to
-- vote, and the decision is one statement on a distributed PostgreSQL too.
--
-- Every row is locked first, in ascending key order (refused otherwise, so
-- that concurrent statements lock rows in one order and never deadlock, and
-- no key is given twice), read once, and written once at the end. Each row comes with
-- its limit's figures; a row's checks all count against those. Each check
-- is decided by its algorithm's step (migration 000012), as every other
-- statement decides it. The queue functions of migration 000006 stay for
-- the statements of earlier versions of pgrl.

-- pgrl_check_row_order refuses rows that are not in strictly ascending key
-- order: a key given twice would be read twice and written twice, losing
-- one of its counts, and rows out of order could deadlock with another
-- statement.
CREATE FUNCTION pgrl_check_row_order(keys bytea[], k integer) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF k > 1 AND keys[k] <= keys[k - 1] THEN
        RAISE EXCEPTION 'pgrl: rows % and % of a check statement are not in ascending key order', k - 1, k
            USING ERRCODE = '22023', HINT = 'give each key once, sorted by its bytes';
    END IF;
END
$$;

CREATE FUNCTION pgrl_fixed_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    rows integer[], costs bigint[], up_to boolean[], groups integer[], vetoes boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, count bigint, allowed boolean,
               expires_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    n       integer := coalesce(array_length(keys, 1), 0);
    m       integer := coalesce(array_length(costs, 1), 0);
    end_us  bigint[];
    cnt     bigint[];
    last    boolean[];
    counts  bigint[];
    verdict boolean[];
    gave    bigint[];
    c       bigint;
    r       integer;
    e       integer;
    i       integer := 1;
    ok      boolean;
    s       pgrl_fixed_window_step;
BEGIN
    FOR k IN 1 .. n LOOP
        PERFORM pgrl_check_row_order(keys, k);
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
    WHILE i <= m LOOP
        -- The checks i .. e are one decision: a group, or a check alone.
        e := i;
        WHILE groups[i] <> 0 AND e < m AND groups[e + 1] = groups[i] LOOP
            e := e + 1;
        END LOOP;
        ok := true;
        FOR j IN i .. e LOOP
            r := rows[j];
            s := pgrl_fixed_window_take(end_us[r], cnt[r], costs[j], max_counts[r], penalties[r], up_to[j]);
            counts[j] := s.count; verdict[j] := s.allowed; gave[j] := s.granted;
            ok := ok AND (groups[j] = 0 OR s.allowed OR NOT vetoes[j]);
        END LOOP;
        FOR j IN i .. e LOOP
            r := rows[j];
            IF ok THEN
                cnt[r] := counts[j];
                last[r] := verdict[j];
            END IF;
            check_index := j; granted := CASE WHEN ok THEN gave[j] ELSE 0 END; count := counts[j];
            allowed := verdict[j]; expires_at_us := end_us[r]; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        i := e + 1;
    END LOOP;
    FOR k IN 1 .. n LOOP
        CONTINUE WHEN last[k] IS NULL;
        UPDATE pgrl_fixed_window AS t
           SET count = cnt[k], allowed = last[k], updated_at = greatest(t.updated_at, ts)
         WHERE t.key = keys[k] AND t.expires_at = pgrl_from_epoch_us(end_us[k]);
    END LOOP;
END
$$;

CREATE FUNCTION pgrl_token_bucket_take_checks(
    keys bytea[], capacities float8[], refills_per_us float8[], penalties boolean[],
    rows integer[], costs bigint[], up_to boolean[], groups integer[], vetoes boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, tokens_bits bigint, updated_at_us bigint,
               full_at_us bigint, allowed boolean)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    n       integer := coalesce(array_length(keys, 1), 0);
    m       integer := coalesce(array_length(costs, 1), 0);
    bal     float8[];
    upd     bigint[];
    last    boolean[];
    bals    float8[];
    upds    bigint[];
    verdict boolean[];
    gave    bigint[];
    b       float8;
    u       bigint;
    r       integer;
    e       integer;
    i       integer := 1;
    ok      boolean;
    s       pgrl_token_bucket_step;
BEGIN
    FOR k IN 1 .. n LOOP
        PERFORM pgrl_check_row_order(keys, k);
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
    WHILE i <= m LOOP
        e := i;
        WHILE groups[i] <> 0 AND e < m AND groups[e + 1] = groups[i] LOOP
            e := e + 1;
        END LOOP;
        ok := true;
        FOR j IN i .. e LOOP
            r := rows[j];
            s := pgrl_token_bucket_take(bal[r], upd[r], now_at, costs[j], capacities[r], refills_per_us[r],
                                        penalties[r], up_to[j]);
            bals[j] := s.tokens; upds[j] := s.updated_at_us; verdict[j] := s.allowed; gave[j] := s.granted;
            ok := ok AND (groups[j] = 0 OR s.allowed OR NOT vetoes[j]);
        END LOOP;
        FOR j IN i .. e LOOP
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
        i := e + 1;
    END LOOP;
    FOR k IN 1 .. n LOOP
        CONTINUE WHEN last[k] IS NULL;
        UPDATE pgrl_token_bucket AS t
           SET tokens = bal[k], updated_at = pgrl_from_epoch_us(upd[k]),
               full_at = pgrl_token_bucket_full_at(pgrl_from_epoch_us(upd[k]), bal[k], capacities[k],
                                                   refills_per_us[k]),
               allowed = last[k]
         WHERE t.key = keys[k];
    END LOOP;
END
$$;

CREATE FUNCTION pgrl_sliding_window_take_checks(
    keys bytea[], max_counts bigint[], windows_us bigint[], penalties boolean[],
    rows integer[], costs bigint[], up_to boolean[], groups integer[], vetoes boolean[], at timestamptz)
RETURNS TABLE (check_index integer, granted bigint, window_start_us bigint, count bigint, prev_count bigint,
               allowed boolean, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    n       integer := coalesce(array_length(keys, 1), 0);
    m       integer := coalesce(array_length(costs, 1), 0);
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
    a       bigint;
    b       bigint;
    c       bigint;
    r       integer;
    e       integer;
    i       integer := 1;
    ok      boolean;
    s       pgrl_sliding_window_step;
BEGIN
    FOR k IN 1 .. n LOOP
        PERFORM pgrl_check_row_order(keys, k);
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
    WHILE i <= m LOOP
        e := i;
        WHILE groups[i] <> 0 AND e < m AND groups[e + 1] = groups[i] LOOP
            e := e + 1;
        END LOOP;
        ok := true;
        FOR j IN i .. e LOOP
            r := rows[j];
            s := pgrl_sliding_window_take(ws[r], cur[r], prev[r], now_at, windows_us[r], costs[j], max_counts[r],
                                          penalties[r], up_to[j]);
            wss[j] := s.window_start_us; curs[j] := s.count; prevs[j] := s.prev_count;
            verdict[j] := s.allowed; gave[j] := s.granted;
            ok := ok AND (groups[j] = 0 OR s.allowed OR NOT vetoes[j]);
        END LOOP;
        FOR j IN i .. e LOOP
            r := rows[j];
            IF ok THEN
                ws[r] := wss[j]; cur[r] := curs[j]; prev[r] := prevs[j];
                last[r] := verdict[j];
            END IF;
            check_index := j; granted := CASE WHEN ok THEN gave[j] ELSE 0 END; window_start_us := wss[j];
            count := curs[j]; prev_count := prevs[j]; allowed := verdict[j]; now_us := now_at;
            RETURN NEXT;
        END LOOP;
        i := e + 1;
    END LOOP;
    FOR k IN 1 .. n LOOP
        CONTINUE WHEN last[k] IS NULL;
        UPDATE pgrl_sliding_window AS t
           SET window_start = pgrl_from_epoch_us(ws[k]), count = cur[k], prev_count = prev[k],
               expires_at = pgrl_from_epoch_us(ws[k] + 2 * windows_us[k]), allowed = last[k],
               updated_at = greatest(t.updated_at, ts)
         WHERE t.key = keys[k];
    END LOOP;
END
$$;
