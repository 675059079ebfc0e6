-- Token bucket leases: units out on lease count against the capacity.
--
-- A lease (package lease) takes a slice of a key's quota in one statement
-- and spends it later, in memory. For the windows that is sound as it is:
-- the units are counted in the window they were granted in. A bucket,
-- though, refills up to its capacity while the units are out, so a full
-- bucket plus the units still out on lease would admit more than the burst.
-- So the row counts what it leased, and every check refills the bucket up
-- to the capacity less the units that may still be out, instead of up to
-- the capacity:
--
--   tokens + units possibly out on lease <= capacity, at every write.
--
-- A lease taken at instant t may be used until t + tau at most, tau being
-- pgrl_token_bucket_lease_us (1 second; ratelimit.TokenBucketLeaseTime is
-- the same). Leases are counted per epoch of tau, epochs aligned on
-- multiples of tau since the Unix epoch: lease_epoch_us is the start of the
-- epoch that leased counts, and leased_prev counts the epoch before it. A
-- lease counted in epoch E is over by E + 2 tau, so the units possibly out
-- at an instant are leased + leased_prev while it is in epoch E (or before
-- it: a check that waited on the row lock), leased alone in the next epoch,
-- and none after. The capacity is thus lowered by at most the units leased
-- in the current and the previous second. Nullable columns without a
-- default: adding them rewrites nothing; NULL counts no units.
--
-- Every check's upsert also writes, in its insert arm, the lease epoch of
-- its own instant (a new row has leased NULL: nothing is leased). Its update
-- arm reads that epoch back from the proposed row (excluded.lease_epoch_us),
-- as it reads the instant (excluded.updated_at): the planner inlines the
-- step only when each argument it uses several times is cheap, and the
-- capacity less the leased units, computed from the instant converted
-- again, is not (cost_qual_eval: more than 10 operators).
--
-- full_at (rl-cleanup deletes rows whose bucket is full again, which are
-- the same as no row) is never before the end of the epoch after the lease
-- epoch while the row counts leased units: deleting the row earlier would
-- forget the units still out, and a fresh full bucket would over-admit.
--
-- A slice is taken in a check statement, coalesced with other checks, by
-- the overload of pgrl_token_bucket_take_checks with mins and shares (the
-- last function below), as migration 000015 has the windows' taken; its
-- unused units are given back by pgrl_token_bucket_return_slice.
ALTER TABLE pgrl_token_bucket ADD COLUMN lease_epoch_us bigint, ADD COLUMN leased bigint,
                              ADD COLUMN leased_prev bigint;

COMMENT ON COLUMN pgrl_token_bucket.lease_epoch_us IS 'start of the lease epoch leased counts, in microseconds';
COMMENT ON COLUMN pgrl_token_bucket.leased IS 'units leased in that epoch';
COMMENT ON COLUMN pgrl_token_bucket.leased_prev IS 'units leased in the epoch before';

-- The helpers are LANGUAGE sql functions of one expression, IMMUTABLE, so
-- that the planner inlines them and a distributed PostgreSQL (Citus)
-- accepts them in an upsert's update arm and in RETURNING (migrations 000005
-- and 000012 say how). gen's TestHelpersAreInlined checks them too. On
-- Citus, rl-migrate pins those a statement sends to the workers
-- (migration.StepFunctions), as it pins the steps: their bodies call
-- pgrl_token_bucket_lease_us, which a worker's session would not find.

-- pgrl_token_bucket_lease_us is tau: how long a lease taken at now_us may be
-- used, 1 second whatever the instant. It takes an instant only to be
-- inlined: the planner runs any IMMUTABLE function of constants (none at
-- all, for a constant) at plan time, once per call in every plan, instead.
CREATE FUNCTION pgrl_token_bucket_lease_us(now_us bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000000::bigint $$;

-- pgrl_token_bucket_lease_epoch_us is the start of the lease epoch that
-- holds now_us.
CREATE FUNCTION pgrl_token_bucket_lease_epoch_us(now_us bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pgrl_window_start_us(now_us, pgrl_token_bucket_lease_us(now_us)) $$;

-- pgrl_token_bucket_leased is how many units a row's leases may still have
-- out at now_us: leased + leased_prev in the row's lease epoch (or before
-- it), leased in the next epoch, none after (and none for NULLs). The bucket
-- refills up to its capacity less that. (No CASE x WHEN v here: Citus sends
-- the inlined statement to its workers as SQL, and deparsed, that form can
-- come back as x = (condition).)
CREATE FUNCTION pgrl_token_bucket_leased(lease_epoch_us bigint, leased bigint, leased_prev bigint, now_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN now_us < lease_epoch_us + pgrl_token_bucket_lease_us(now_us)
                THEN coalesce(leased, 0) + coalesce(leased_prev, 0)
                WHEN now_us < lease_epoch_us + 2 * pgrl_token_bucket_lease_us(now_us)
                THEN coalesce(leased, 0)
                ELSE 0 END
$$;

-- pgrl_token_bucket_lease_roll is a row's leased (previous false) or
-- leased_prev (previous true) rolled forward to the lease epoch of now_us:
-- unchanged while now_us is in the row's epoch (or before it: the row keeps
-- its later epoch); leased becomes leased_prev in the next epoch; both are
-- 0 after.
CREATE FUNCTION pgrl_token_bucket_lease_roll(lease_epoch_us bigint, leased bigint, leased_prev bigint, now_us bigint,
                                             previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN now_us < lease_epoch_us + pgrl_token_bucket_lease_us(now_us)
                THEN coalesce(CASE WHEN previous THEN leased_prev ELSE leased END, 0)
                WHEN now_us < lease_epoch_us + 2 * pgrl_token_bucket_lease_us(now_us) AND previous
                THEN coalesce(leased, 0)
                ELSE 0 END
$$;

-- pgrl_token_bucket_lease_over_at is when no lease a row counts can be out
-- any more: the end of the epoch after its lease epoch; NULL when it counts
-- no units (greatest() then passes over it).
CREATE FUNCTION pgrl_token_bucket_lease_over_at(lease_epoch_us bigint, leased bigint, leased_prev bigint)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgrl_ts(CASE WHEN coalesce(leased, 0) + coalesce(leased_prev, 0) > 0
                        THEN lease_epoch_us + 2 * pgrl_token_bucket_lease_us(lease_epoch_us) END)
$$;

-- pgrl_token_bucket_lease_returnable is how many units of a lease taken at
-- at_us the row's leased (previous false) or leased_prev (previous true)
-- can take back at now_us: that count when it is the one of at_us's epoch
-- (leased when the row's lease epoch is at_us's, leased_prev when the row
-- has moved one epoch on) and at_us's epoch still counts at now_us (now_us
-- is at most one epoch past it); else 0. Units no longer counted are not
-- taken back: the bucket has refilled past them already.
CREATE FUNCTION pgrl_token_bucket_lease_returnable(lease_epoch_us bigint, leased bigint, leased_prev bigint,
                                                   at_us bigint, now_us bigint, previous boolean)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN now_us >= pgrl_token_bucket_lease_epoch_us(at_us) + 2 * pgrl_token_bucket_lease_us(at_us) THEN 0
                WHEN previous AND lease_epoch_us - pgrl_token_bucket_lease_epoch_us(at_us)
                                  = pgrl_token_bucket_lease_us(at_us)
                THEN coalesce(leased_prev, 0)
                WHEN NOT previous AND lease_epoch_us = pgrl_token_bucket_lease_epoch_us(at_us)
                THEN coalesce(leased, 0)
                ELSE 0 END
$$;

-- pgrl_token_bucket_slice is a slice's step: a partial grant of at most n
-- units, shrinking as the bucket empties, never below the check's cost min.
-- It only composes the token bucket's step (migration 000012), and the
-- fixed and sliding windows compose theirs the same way:
--   probe: what is left, at most n * share (a partial grant, no penalty);
--   ask:   n, or ceil(probe / share) when that is less, never below min;
--   the partial grant of ask, when it grants at least min;
--   else the check of min itself, under penalty if set: a denial, which
--   charges min (the check's own cost), never the ask.
-- capacity is the bucket's capacity less the units out on lease. PL/pgSQL,
-- not one SQL expression: a later step's ask is an earlier step's result,
-- and PostgreSQL inlines a function only when every argument it uses more
-- than once is cheap, which a step's result is not; the step would then be
-- run through the SQL-function executor (its body parsed and planned again
-- in every transaction). Here each step is inlined into an expression that
-- is planned once per session, and the function stays IMMUTABLE.
CREATE FUNCTION pgrl_token_bucket_slice(tokens float8, updated_at_us bigint, now_us bigint, n bigint, min bigint,
                                        share bigint, capacity float8, refill_per_us float8, penalty boolean)
RETURNS pgrl_token_bucket_step
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    probe bigint;
    ask   bigint;
    s     pgrl_token_bucket_step;
BEGIN
    probe := (pgrl_token_bucket_take(tokens, updated_at_us, now_us,
                                     least(n::numeric * share, 9223372036854775807)::bigint,
                                     capacity, refill_per_us, false, true)).granted;
    ask := least(n, greatest(min, ceil(probe::numeric / share)::bigint));
    s := pgrl_token_bucket_take(tokens, updated_at_us, now_us, ask, capacity, refill_per_us, false, true);
    IF s.granted >= min THEN
        RETURN s;
    END IF;
    RETURN pgrl_token_bucket_take(tokens, updated_at_us, now_us, min, capacity, refill_per_us, penalty, false);
END
$$;

-- pgrl_token_bucket_return_slice gives back n unused units of a lease taken
-- at at (the updated_at_us its slice's check returned, which is the lease's
-- instant): it takes them off the leased count
-- of at's epoch (pgrl_token_bucket_lease_returnable: at most what that
-- count holds, and nothing once the lease is over or the row has moved two
-- epochs on), puts them back as tokens, and refills the bucket to the
-- check's own instant (now_at, NULL for now(): tests pin it) up to the
-- capacity less what stays leased. Adding first and refilling after is
-- refilling first and adding after: the units taken back counted at that
-- instant. It returns how many units it gave back (0 for a key without a
-- row). The UPDATE reads scalar variables only.
CREATE FUNCTION pgrl_token_bucket_return_slice(row_key bytea, at timestamptz, n bigint, capacity float8,
                                               refill_per_us float8, now_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    now_us    bigint := pgrl_epoch_us(coalesce(now_at, now()));
    at_us     bigint := pgrl_epoch_us(at);
    bal       float8;
    upd       bigint;
    ep        bigint;
    cur       bigint;
    prev      bigint;
    from_cur  bigint;
    from_prev bigint;
    fin       timestamptz;
BEGIN
    SELECT t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
      INTO bal, upd, ep, cur, prev
      FROM pgrl_token_bucket AS t
     WHERE t.key = row_key
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    from_cur := least(n, pgrl_token_bucket_lease_returnable(ep, cur, prev, at_us, now_us, false));
    from_prev := least(n, pgrl_token_bucket_lease_returnable(ep, cur, prev, at_us, now_us, true));
    IF from_cur + from_prev <= 0 THEN
        RETURN 0;
    END IF;
    cur := cur - from_cur;
    prev := prev - from_prev;
    bal := pgrl_token_bucket_refill(bal + (from_cur + from_prev), greatest(now_us - upd, 0),
                                    capacity - pgrl_token_bucket_leased(ep, cur, prev, now_us), refill_per_us);
    upd := greatest(upd, now_us);
    fin := greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upd), bal, capacity, refill_per_us),
                    pgrl_token_bucket_lease_over_at(ep, cur, prev));
    UPDATE pgrl_token_bucket AS t
       SET tokens = bal, updated_at = pgrl_from_epoch_us(upd), full_at = fin, leased = cur, leased_prev = prev
     WHERE t.key = row_key;
    RETURN from_cur + from_prev;
END
$$;

-- The check queues (migration 000012) and the check functions (migration
-- 000014) count against the capacity less the units out on lease, read
-- once per row, and keep full_at after the leases; their signatures and
-- results are unchanged. A new row is made without a lease.
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
    ep     bigint;
    cur    bigint;
    prev   bigint;
    cap    float8;
    over   timestamptz;
    fin    timestamptz;
    s      pgrl_token_bucket_step;
BEGIN
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        SELECT t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
          INTO bal, upd, ep, cur, prev
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacities[k], ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
                 INTO bal, upd, ep, cur, prev;
        END IF;
        cap := capacities[k] - pgrl_token_bucket_leased(ep, cur, prev, now_at);
        over := pgrl_token_bucket_lease_over_at(ep, cur, prev);
        FOR i IN first .. ends[k] LOOP
            s := pgrl_token_bucket_take(bal, upd, now_at, costs[i], cap, refills_per_us[k], penalties[k], up_to[i]);
            bal := s.tokens;
            upd := s.updated_at_us;
            fin := greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upd), bal, capacities[k], refills_per_us[k]),
                            over);
            check_index := i; granted := s.granted; tokens_bits := pgrl_float8_bits(bal);
            updated_at_us := upd; full_at_us := pgrl_epoch_us(fin); allowed := s.allowed;
            RETURN NEXT;
        END LOOP;
        UPDATE pgrl_token_bucket AS t
           SET tokens = bal, updated_at = pgrl_from_epoch_us(upd), full_at = fin, allowed = s.allowed
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
    caps    float8[];
    overs   timestamptz[];
    last    boolean[];
    bals    float8[];
    upds    bigint[];
    verdict boolean[];
    gave    bigint[];
    b       float8;
    u       bigint;
    ep      bigint;
    cur     bigint;
    prev    bigint;
    cap     float8;
    refill  float8;
    over    timestamptz;
    fin     timestamptz;
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
        SELECT t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
          INTO b, u, ep, cur, prev
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacities[k], ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
                 INTO b, u, ep, cur, prev;
        END IF;
        bal[k] := b;
        upd[k] := u;
        caps[k] := capacities[k] - pgrl_token_bucket_leased(ep, cur, prev, now_at);
        overs[k] := pgrl_token_bucket_lease_over_at(ep, cur, prev);
    END LOOP;
    FOR g IN 1 .. coalesce(array_length(runs, 1), 0) LOOP
        r := runs[g];
        IF r > 0 THEN
            b := bal[r];
            u := upd[r];
            FOR i IN first .. ends[g] LOOP
                s := pgrl_token_bucket_take(b, u, now_at, costs[i], caps[r], refills_per_us[r], penalties[r], up_to[i]);
                b := s.tokens;
                u := s.updated_at_us;
                check_index := i; granted := s.granted; tokens_bits := pgrl_float8_bits(b); updated_at_us := u;
                full_at_us := pgrl_epoch_us(greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, capacities[r],
                                                                               refills_per_us[r]), overs[r]));
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
                s := pgrl_token_bucket_take(bal[r], upd[r], now_at, costs[j], caps[r], refills_per_us[r],
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
                full_at_us := pgrl_epoch_us(greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upds[j]), bals[j],
                                                                               capacities[r], refills_per_us[r]),
                                                     overs[r]));
                allowed := verdict[j];
                RETURN NEXT;
            END LOOP;
        END IF;
        first := ends[g] + 1;
    END LOOP;
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        CONTINUE WHEN last[k] IS NULL;
        b := bal[k]; u := upd[k]; ok := last[k]; cap := capacities[k]; refill := refills_per_us[k]; over := overs[k];
        fin := greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, cap, refill), over);
        UPDATE pgrl_token_bucket AS t
           SET tokens = b, updated_at = pgrl_from_epoch_us(u), full_at = fin, allowed = ok
         WHERE t.key = keys[k];
    END LOOP;
END
$$;

-- pgrl_token_bucket_take_checks with mins and shares, as migration 000015
-- gives the windows' check functions, so that a bucket's slices are
-- coalesced with other checks: a lone check with shares[i] > 0 is a slice
-- for a lease, decided by pgrl_token_bucket_slice against the capacity less
-- the units out on lease. The row's lease counts are rolled forward to the
-- lease epoch of the statement's instant (the row's epoch when that is
-- later: a statement that waited on the row lock may come after a later
-- one), even for a denial, and the units granted are added to the current
-- count. The row's capacity less the leased units is lowered by them at
-- once, so the row's later checks in the statement count against what a
-- later statement would read, and the counts are written back with the row:
-- the invariant above holds whether a key's slices and plain checks come in
-- one statement or several. A slice is always a lone check, never in a
-- group (runs[g] = 0). The version above stays, for the statements of
-- earlier versions of pgrl. The final UPDATE reads scalar variables only
-- (migration 000014 says why).
CREATE FUNCTION pgrl_token_bucket_take_checks(
    keys bytea[], capacities float8[], refills_per_us float8[], penalties boolean[],
    runs integer[], ends integer[], rows integer[], costs bigint[], up_to boolean[], vetoes boolean[],
    mins bigint[], shares bigint[], at timestamptz)
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
    caps    float8[];
    overs   timestamptz[];
    eps     bigint[];
    lcur    bigint[];
    lprev   bigint[];
    last    boolean[];
    bals    float8[];
    upds    bigint[];
    verdict boolean[];
    gave    bigint[];
    b       float8;
    u       bigint;
    ep      bigint;
    cur     bigint;
    prev    bigint;
    cap     float8;
    refill  float8;
    over    timestamptz;
    fin     timestamptz;
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
        SELECT t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
          INTO b, u, ep, cur, prev
          FROM pgrl_token_bucket AS t
         WHERE t.key = keys[k]
           FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO pgrl_token_bucket AS t (key, tokens, updated_at, full_at, allowed)
            VALUES (keys[k], capacities[k], ts, ts, true)
            ON CONFLICT (key) DO UPDATE SET tokens = t.tokens
            RETURNING t.tokens, pgrl_us(t.updated_at), t.lease_epoch_us, t.leased, t.leased_prev
                 INTO b, u, ep, cur, prev;
        END IF;
        bal[k] := b;
        upd[k] := u;
        eps[k] := ep; lcur[k] := cur; lprev[k] := prev;
        caps[k] := capacities[k] - pgrl_token_bucket_leased(ep, cur, prev, now_at);
        overs[k] := pgrl_token_bucket_lease_over_at(ep, cur, prev);
    END LOOP;
    FOR g IN 1 .. coalesce(array_length(runs, 1), 0) LOOP
        r := runs[g];
        IF r > 0 THEN
            b := bal[r];
            u := upd[r];
            FOR i IN first .. ends[g] LOOP
                IF shares[i] > 0 THEN
                    s := pgrl_token_bucket_slice(b, u, now_at, costs[i], mins[i], shares[i], caps[r],
                                                 refills_per_us[r], penalties[r]);
                    -- The counts rolled forward to the statement's epoch,
                    -- the grant added to its count; the capacity and
                    -- full_at follow, as in the row a later statement reads.
                    ep := eps[r]; cur := lcur[r]; prev := lprev[r];
                    lprev[r] := pgrl_token_bucket_lease_roll(ep, cur, prev, now_at, true);
                    lcur[r] := pgrl_token_bucket_lease_roll(ep, cur, NULL, now_at, false) + s.granted;
                    eps[r] := greatest(ep, pgrl_token_bucket_lease_epoch_us(now_at));
                    caps[r] := capacities[r] - pgrl_token_bucket_leased(eps[r], lcur[r], lprev[r], now_at);
                    overs[r] := pgrl_token_bucket_lease_over_at(eps[r], lcur[r], lprev[r]);
                ELSE
                    s := pgrl_token_bucket_take(b, u, now_at, costs[i], caps[r], refills_per_us[r], penalties[r],
                                                up_to[i]);
                END IF;
                b := s.tokens;
                u := s.updated_at_us;
                check_index := i; granted := s.granted; tokens_bits := pgrl_float8_bits(b); updated_at_us := u;
                full_at_us := pgrl_epoch_us(greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, capacities[r],
                                                                               refills_per_us[r]), overs[r]));
                allowed := s.allowed;
                RETURN NEXT;
            END LOOP;
            bal[r] := b;
            upd[r] := u;
            last[r] := s.allowed;
        ELSE
            -- A group: decided, then applied only if every veto allows. It
            -- holds no slice.
            ok := true;
            FOR j IN first .. ends[g] LOOP
                r := rows[j];
                s := pgrl_token_bucket_take(bal[r], upd[r], now_at, costs[j], caps[r], refills_per_us[r],
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
                full_at_us := pgrl_epoch_us(greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(upds[j]), bals[j],
                                                                               capacities[r], refills_per_us[r]),
                                                     overs[r]));
                allowed := verdict[j];
                RETURN NEXT;
            END LOOP;
        END IF;
        first := ends[g] + 1;
    END LOOP;
    FOR k IN 1 .. coalesce(array_length(keys, 1), 0) LOOP
        CONTINUE WHEN last[k] IS NULL;
        b := bal[k]; u := upd[k]; ok := last[k]; cap := capacities[k]; refill := refills_per_us[k]; over := overs[k];
        ep := eps[k]; cur := lcur[k]; prev := lprev[k];
        fin := greatest(pgrl_token_bucket_full_at(pgrl_from_epoch_us(u), b, cap, refill), over);
        UPDATE pgrl_token_bucket AS t
           SET tokens = b, updated_at = pgrl_from_epoch_us(u), full_at = fin, allowed = ok,
               lease_epoch_us = ep, leased = cur, leased_prev = prev
         WHERE t.key = keys[k];
    END LOOP;
END
$$;
