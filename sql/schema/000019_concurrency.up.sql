-- Concurrency limits: at most N slots of a key held at once, across every
-- process (ratelimit.Concurrency, Limiter.Acquire).
--
-- One row per key holds the key's slots: each a token (8 bytes naming the
-- holding process, 8 numbering its acquisitions) and the instant, in
-- microseconds since the Unix epoch, until which it is held. A slot is a
-- lease: its holder extends it while the work runs (one statement per
-- process per interval, for all its keys), releases it when the work ends,
-- and loses it at until_us when it stops extending (a process killed with
-- kill -9). So the row lock on the key serialises every acquire and
-- release of that key, and a slot whose until_us has passed counts for
-- nothing, whoever forgot it.
--
-- UNLOGGED, fillfactor 50 and the autovacuum settings of the counters
-- (migration 000001), for the same reasons: short-lived, hot rows.
-- expires_at is the latest until_us: after it the row holds nothing, and
-- rl-cleanup deletes it.
CREATE TYPE pgrl_slot AS (token bytea, until_us bigint);

CREATE UNLOGGED TABLE pgrl_concurrency (
    key        bytea       NOT NULL,
    slots      pgrl_slot[] NOT NULL,
    expires_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    CONSTRAINT pgrl_concurrency_pkey PRIMARY KEY (key)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

COMMENT ON TABLE pgrl_concurrency IS 'pgrl concurrency limits: one row per key, the slots held';
COMMENT ON COLUMN pgrl_concurrency.slots IS
    'the slots held: holder token and the instant (us since the epoch) the slot lapses';
COMMENT ON COLUMN pgrl_concurrency.expires_at IS 'latest lapse of any slot; the row holds nothing after it';

-- pgrl_concurrency_step is the concurrency limit's step: the slots of a key
-- at now_us after token tok acquires one (ttl_us > 0) or releases its own
-- (ttl_us = 0). Lapsed slots are dropped. An acquire is granted when fewer
-- than max_held slots are live; one by a token that already holds a slot
-- (a retry) extends that slot and takes no other. A release of a slot that
-- is not held (released before, lapsed) changes nothing else. The token is
-- held afterwards exactly when the acquire was granted: pgrl_concurrency_holds.
CREATE FUNCTION pgrl_concurrency_step(slots pgrl_slot[], now_us bigint, tok bytea, ttl_us bigint, max_held bigint)
    RETURNS pgrl_slot[]
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s      pgrl_slot;
    live   pgrl_slot[] := '{}';
    holds  boolean := false;
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        CONTINUE WHEN s.until_us <= now_us;
        IF s.token = tok THEN
            holds := true;
            CONTINUE WHEN ttl_us = 0;
            s.until_us := greatest(s.until_us, now_us + ttl_us);
        END IF;
        live := live || s;
    END LOOP;
    IF ttl_us > 0 AND NOT holds AND cardinality(live) < max_held THEN
        live := live || ROW(tok, now_us + ttl_us)::pgrl_slot;
    END IF;
    RETURN live;
END
$$;

-- pgrl_concurrency_renew extends the live slots of slots named in
-- renewals, whose until_us is a ttl, to now_us + that ttl, and drops lapsed
-- slots. A lapsed slot is never revived: another holder may have its place.
CREATE FUNCTION pgrl_concurrency_renew(slots pgrl_slot[], now_us bigint, renewals pgrl_slot[])
    RETURNS pgrl_slot[]
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s    pgrl_slot;
    r    pgrl_slot;
    live pgrl_slot[] := '{}';
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        CONTINUE WHEN s.until_us <= now_us;
        FOREACH r IN ARRAY coalesce(renewals, '{}') LOOP
            IF r.token = s.token THEN
                s.until_us := greatest(s.until_us, now_us + r.until_us);
                EXIT;
            END IF;
        END LOOP;
        live := live || s;
    END LOOP;
    RETURN live;
END
$$;

-- pgrl_concurrency_holds reports whether token tok holds a live slot.
-- These readers are PL/pgSQL loops over the few slots of a key, not SQL
-- over unnest(): a SQL function with a FROM clause is not inlined, and each
-- call would set up a query of its own (four of them made an acquire five
-- times as slow as its upsert).
CREATE FUNCTION pgrl_concurrency_holds(slots pgrl_slot[], now_us bigint, tok bytea)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s pgrl_slot;
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        IF s.token = tok AND s.until_us > now_us THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$$;

-- pgrl_concurrency_held counts the live slots; pgrl_concurrency_next_us is
-- the earliest lapse of a live slot (NULL for none), when a place frees at
-- the latest if no holder releases; pgrl_concurrency_last_us the latest.
CREATE FUNCTION pgrl_concurrency_held(slots pgrl_slot[], now_us bigint)
    RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s pgrl_slot;
    n bigint := 0;
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        IF s.until_us > now_us THEN
            n := n + 1;
        END IF;
    END LOOP;
    RETURN n;
END
$$;

CREATE FUNCTION pgrl_concurrency_next_us(slots pgrl_slot[], now_us bigint)
    RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s pgrl_slot;
    m bigint;
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        IF s.until_us > now_us AND (m IS NULL OR s.until_us < m) THEN
            m := s.until_us;
        END IF;
    END LOOP;
    RETURN m;
END
$$;

CREATE FUNCTION pgrl_concurrency_last_us(slots pgrl_slot[], now_us bigint)
    RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s pgrl_slot;
    m bigint;
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        IF s.until_us > now_us AND (m IS NULL OR s.until_us > m) THEN
            m := s.until_us;
        END IF;
    END LOOP;
    RETURN m;
END
$$;

-- pgrl_concurrency_tokens lists the tokens of holder's live slots: what a
-- process's extension learns it still holds.
CREATE FUNCTION pgrl_concurrency_tokens(slots pgrl_slot[], now_us bigint, holder bytea)
    RETURNS bytea[]
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    s pgrl_slot;
    out bytea[] := '{}';
BEGIN
    FOREACH s IN ARRAY coalesce(slots, '{}') LOOP
        IF s.until_us > now_us AND substr(s.token, 1, 8) = holder THEN
            out := out || s.token;
        END IF;
    END LOOP;
    RETURN out;
END
$$;

-- A role that may check the counters may acquire slots: the privileges
-- granted on pgrl_sliding_window are granted here too (as migration 000017
-- does for pgrl_request).
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT a.grantee, r.rolname, a.privilege_type
               FROM pg_catalog.pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
               LEFT JOIN pg_catalog.pg_roles AS r ON r.oid = a.grantee
              WHERE c.oid = 'pgrl_sliding_window'::regclass AND a.grantee <> c.relowner
                AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE') LOOP
        IF g.grantee = 0 THEN
            EXECUTE format('GRANT %s ON pgrl_concurrency TO PUBLIC', g.privilege_type);
        ELSE
            EXECUTE format('GRANT %s ON pgrl_concurrency TO %I', g.privilege_type, g.rolname);
        END IF;
    END LOOP;
END
$$;
