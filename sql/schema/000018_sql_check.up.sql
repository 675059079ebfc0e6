-- pgrl_check: a check against a stored policy in one SQL call, for clients
-- in any language (psql, Python, Node, PostgREST, a Supabase RPC):
--
--   SELECT * FROM pgrl_check('api', 'tenant-42');      -- one unit
--   SELECT * FROM pgrl_check('uploads', 'user-7', 512); -- a cost
--
-- It reads the policy (pgrl_policy) and the key's live override
-- (pgrl_policy_override), and counts in the same counter as a Go limiter of
-- the same policy (package policy) and key: the counter's key is the one
-- ratelimit.StoredKey makes (pgrl_stored_key), under the name the Go side
-- gives it (the policy's name, and for the window algorithms the window:
-- ratelimit.RateName). The check itself is the algorithm's check function
-- (migrations 000014 to 000016) with one check, so its arithmetic is the
-- step every other statement uses, on the database clock.
--
-- It returns what a ratelimit.Decision holds, as the Go side computes it:
-- allowed; granted (the cost, or 0); "limit" (the window's quota, or the
-- token bucket's burst); used and remaining after the check; retry_after
-- (zero when allowed) and retry_after_seconds (rounded up, for an HTTP
-- Retry-After header); reset_at (when the key is wholly available again)
-- and reset_after_seconds (rounded up).
--
-- Bad input raises, and counts nothing:
--   22004 (null_value_not_allowed)   a NULL policy, key or cost;
--   42704 (undefined_object)         no policy has that name;
--   22023 (invalid_parameter_value)  a cost below 1, or above what the
--                                    limit admits at once;
--   54000 (program_limit_exceeded)   a readable key too long to store.
-- Each message says what to fix. The function runs with the search_path it
-- was created with, so that it finds pgrl's tables whatever the caller's.
CREATE FUNCTION pgrl_check(policy text, key text, cost bigint DEFAULT 1)
RETURNS TABLE (allowed boolean, granted bigint, "limit" bigint, used bigint, remaining bigint,
               retry_after interval, retry_after_seconds bigint, reset_at timestamptz,
               reset_after_seconds bigint)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    alg      text;
    readable boolean;
    lim      bigint;
    win      interval;
    olim     bigint;
    owin     interval;
    oburst   bigint;
    win_us   bigint;
    cap      bigint;
    pen      boolean;
    k        bytea;
    now_us   bigint;
    wait_us  float8;
    reset_us bigint;
    room     float8;
    x        float8;
    e        bigint;
    fw       record;
    tb       record;
    sw       record;
BEGIN
    IF policy IS NULL OR key IS NULL OR cost IS NULL THEN
        RAISE EXCEPTION 'pgrl_check: policy, key and cost must not be NULL'
            USING ERRCODE = 'null_value_not_allowed',
                  HINT = 'pass a policy name, the caller''s key and a cost of 1 or more';
    END IF;
    SELECT p.algorithm, p.key_mode = 'readable', p."limit", p."window", p.burst, p.penalty
      INTO alg, readable, lim, win, cap, pen
      FROM pgrl_policy AS p
     WHERE p.name = pgrl_check.policy;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgrl_check: no policy is named %', quote_literal(policy)
            USING ERRCODE = 'undefined_object',
                  HINT = 'create it first (rl-policy set, or INSERT INTO pgrl_policy), or check the name''s spelling';
    END IF;
    IF readable AND octet_length(convert_to(key, 'UTF8')) > 2048 THEN
        -- ratelimit.MaxReadableKeyBytes, which an index can hold.
        RAISE EXCEPTION 'pgrl_check: a key of % bytes for policy %, which stores keys readable (at most 2048)',
                        octet_length(convert_to(key, 'UTF8')), quote_literal(policy)
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'shorten the key, or use a policy with key_mode ''hashed'', which takes keys of any length';
    END IF;
    -- The key's override, stored under the policy's name, while it lasts.
    SELECT o."limit", o."window", o.burst INTO olim, owin, oburst
      FROM pgrl_policy_override AS o
     WHERE o.policy = pgrl_check.policy AND o.key = pgrl_stored_key(pgrl_check.policy, pgrl_check.key, readable)
       AND (o.expires_at IS NULL OR o.expires_at > now());
    -- The burst follows the limit it defaults to (policy.Override.Rate).
    cap := coalesce(oburst, cap, olim, lim);
    lim := coalesce(olim, lim);
    win_us := round(date_part('epoch', coalesce(owin, win)) * 1000000)::bigint;
    IF alg <> 'token_bucket' THEN
        cap := lim;
    END IF;
    IF cost < 1 OR cost > cap THEN
        RAISE EXCEPTION 'pgrl_check: cost % for policy %: ask for 1 to % units, what the limit admits at once',
                        cost, quote_literal(policy), cap
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The counter's key, as the Go side names it (ratelimit.RateName for
    -- the window algorithms, whose counters are kept per window).
    k := pgrl_stored_key(CASE WHEN alg = 'token_bucket' THEN policy ELSE policy || '@' || win_us || 'us' END,
                         key, readable);
    CASE alg
    WHEN 'fixed_window' THEN
        SELECT * INTO fw
          FROM pgrl_fixed_window_take_checks(ARRAY[k], ARRAY[lim], ARRAY[win_us], ARRAY[pen], '{1}', '{1}', '{1}',
                                             ARRAY[cost], '{f}', '{t}', '{0}', '{0}', NULL) AS q;
        allowed := fw.allowed; granted := fw.granted; "limit" := lim; used := fw.count;
        remaining := greatest(lim - fw.count, 0); now_us := fw.now_us; reset_us := fw.expires_at_us;
        wait_us := CASE WHEN fw.allowed THEN 0 ELSE fw.expires_at_us - fw.now_us END;
    WHEN 'token_bucket' THEN
        SELECT * INTO tb
          FROM pgrl_token_bucket_take_checks(ARRAY[k], ARRAY[cap::float8], ARRAY[lim::float8 / win_us::float8],
                                             ARRAY[pen], '{1}', '{1}', '{1}', ARRAY[cost], '{f}', '{t}', '{0}', '{0}',
                                             NULL) AS q;
        -- The balance, as the check left it (the row is this transaction's).
        SELECT t.tokens INTO x FROM pgrl_token_bucket AS t WHERE t.key = k;
        allowed := tb.allowed; granted := tb.granted; "limit" := cap;
        used := CASE WHEN floor(x) >= 0 THEN greatest(cap - floor(x)::bigint, 0)
                     ELSE least(cap::numeric - floor(x)::numeric, 9223372036854775807)::bigint END;
        remaining := floor(greatest(x, 0))::bigint; now_us := tb.updated_at_us; reset_us := tb.full_at_us;
        wait_us := CASE WHEN tb.allowed THEN 0 ELSE (cost::float8 - x) / (lim::float8 / win_us::float8) END;
    ELSE
        SELECT * INTO sw
          FROM pgrl_sliding_window_take_checks(ARRAY[k], ARRAY[lim], ARRAY[win_us], ARRAY[pen], '{1}', '{1}', '{1}',
                                               ARRAY[cost], '{f}', '{t}', '{0}', '{0}', NULL) AS q;
        e := least(greatest(sw.now_us - sw.window_start_us, 0), win_us);
        allowed := sw.allowed; granted := sw.granted; "limit" := lim;
        used := least(sw.count::numeric + ceil(sw.prev_count::numeric * (win_us - e) / win_us),
                      9223372036854775807)::bigint;
        remaining := greatest(lim - used, 0); now_us := sw.now_us;
        reset_us := sw.window_start_us + CASE WHEN sw.count = 0 THEN win_us ELSE 2 * win_us END;
        wait_us := 0;
        IF NOT sw.allowed THEN
            -- How long until the estimate leaves room for the cost, nothing
            -- more counted: first the previous window's weight shrinks,
            -- then the current count becomes the previous one.
            room := (lim - sw.count - cost)::float8;
            x := NULL;
            IF room >= 0 AND sw.prev_count > 0 THEN
                x := ceil(win_us::float8 - room * win_us::float8 / sw.prev_count::float8);
                IF x > win_us THEN
                    x := NULL;
                END IF;
            END IF;
            IF x IS NOT NULL THEN
                wait_us := x - e;
            ELSE
                x := 0;
                IF sw.count > 0 THEN
                    x := greatest(ceil(win_us::float8 - (lim - cost)::float8 * win_us::float8 / sw.count::float8), 0);
                END IF;
                wait_us := win_us - e + x;
            END IF;
        END IF;
    END CASE;
    wait_us := ceil(greatest(wait_us, 0));
    retry_after := make_interval(secs => wait_us / 1000000);
    retry_after_seconds := ceil(wait_us / 1000000)::bigint;
    reset_at := pgrl_from_epoch_us(reset_us);
    reset_after_seconds := ceil(greatest(reset_us - now_us, 0)::numeric / 1000000)::bigint;
    RETURN NEXT;
END
$$;
