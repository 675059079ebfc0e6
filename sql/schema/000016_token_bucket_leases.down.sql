-- Drops the check function with slices, restores
-- pgrl_token_bucket_take_queue as migration 000012 made it and
-- pgrl_token_bucket_take_checks as migration 000014 made it, then drops the
-- slice functions, the lease helpers and the lease columns: units out on
-- lease no longer count against the capacity.

DROP FUNCTION pgrl_token_bucket_take_checks(bytea[], float8[], float8[], boolean[], integer[], integer[], integer[],
                                            bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz);

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

CREATE OR REPLACE FUNCTION pgrl_token_bucket_take_checks(
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

DROP FUNCTION pgrl_token_bucket_return_slice(bytea, timestamptz, bigint, float8, float8, timestamptz);
DROP FUNCTION pgrl_token_bucket_slice(float8, bigint, bigint, bigint, bigint, bigint, float8, float8, boolean);
DROP FUNCTION pgrl_token_bucket_lease_returnable(bigint, bigint, bigint, bigint, bigint, boolean);
DROP FUNCTION pgrl_token_bucket_lease_over_at(bigint, bigint, bigint);
DROP FUNCTION pgrl_token_bucket_lease_roll(bigint, bigint, bigint, bigint, boolean);
DROP FUNCTION pgrl_token_bucket_leased(bigint, bigint, bigint, bigint);
DROP FUNCTION pgrl_token_bucket_lease_epoch_us(bigint);
DROP FUNCTION pgrl_token_bucket_lease_us(bigint);

ALTER TABLE pgrl_token_bucket DROP COLUMN leased_prev, DROP COLUMN leased, DROP COLUMN lease_epoch_us;
