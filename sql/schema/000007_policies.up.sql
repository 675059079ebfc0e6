-- Limits stored in the database: policies and per-key overrides.
--
-- pgrl_policy holds one named limit per row (what a ratelimit.Config holds:
-- algorithm, limit, window, burst, penalty, key mode); pgrl_policy_override
-- changes the limit, window or burst of one key of one policy, until an
-- optional expiry. Package policy and the rl-policy command read and write
-- them; a DBA may use plain SQL (docs/POLICIES.md). Unlike the counters,
-- these tables are LOGGED: they are configuration, they survive a crash and
-- they are replicated.
--
-- Every change (INSERT, UPDATE, DELETE, TRUNCATE) of either table sends a
-- NOTIFY on the channel 'pgrl_policy', delivered when the transaction
-- commits. The payload is a JSON object naming the schema, so listeners of
-- two installations in two schemas of one database tell their changes apart:
--   {"schema": "ratelimit", "table": "pgrl_policy", "op": "UPDATE", "policy": "api"}
-- A change of an override also names its key, in hexadecimal, so that a
-- listener reloads that one row:
--   {"schema": "ratelimit", "table": "pgrl_policy_override", "op": "INSERT", "policy": "api",
--    "key": "76a76cf140ebd8f404397ceaee275625"}
-- "policy" is null after a TRUNCATE: reload everything.
--
-- The bounds in the CHECK constraints are the ones ratelimit.Config accepts:
-- a window from 1 millisecond to 366 days (ratelimit.MinWindow, MaxWindow),
-- without months (a month has no fixed length), a token bucket of at most
-- 2^53 tokens (ratelimit.MaxTokens) that refills within 1,000 years, and a
-- stored key no longer than a readable key with its name (256 + 1 + 2048
-- bytes; a hashed key is 16 bytes).

CREATE TABLE pgrl_policy (
    name        text        NOT NULL,
    algorithm   text        NOT NULL DEFAULT 'fixed_window',
    "limit"     bigint      NOT NULL,
    "window"    interval    NOT NULL,
    burst       bigint,
    penalty     boolean     NOT NULL DEFAULT false,
    key_mode    text        NOT NULL DEFAULT 'hashed',
    description text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pgrl_policy_pkey PRIMARY KEY (name),
    CONSTRAINT pgrl_policy_name_check
        CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:/+-]{0,127}$'),
    CONSTRAINT pgrl_policy_algorithm_check
        CHECK (algorithm IN ('fixed_window', 'token_bucket', 'sliding_window')),
    CONSTRAINT pgrl_policy_limit_check CHECK ("limit" > 0),
    CONSTRAINT pgrl_policy_window_check
        CHECK (extract(year FROM "window") = 0 AND extract(month FROM "window") = 0
               AND "window" >= interval '1 millisecond' AND "window" <= interval '366 days'),
    CONSTRAINT pgrl_policy_burst_check CHECK (burst > 0 AND burst <= 9007199254740992),
    CONSTRAINT pgrl_policy_token_bucket_check
        CHECK (algorithm <> 'token_bucket' OR (
               coalesce(burst, "limit") <= 9007199254740992
               AND coalesce(burst, "limit")::numeric * (extract(epoch FROM "window") * 1000000)::numeric
                   <= "limit"::numeric * 31557600000000000)),
    CONSTRAINT pgrl_policy_key_mode_check CHECK (key_mode IN ('hashed', 'readable')),
    CONSTRAINT pgrl_policy_readable_name_check CHECK (key_mode = 'hashed' OR strpos(name, ':') = 0),
    CONSTRAINT pgrl_policy_description_check CHECK (length(description) <= 1000)
);

COMMENT ON TABLE pgrl_policy IS 'pgrl policies: one named limit per row, read by package policy and rl-policy';
COMMENT ON COLUMN pgrl_policy.name IS 'the limiter''s name: scopes its keys (1 to 128 of A-Z a-z 0-9 _ . : / + -)';
COMMENT ON COLUMN pgrl_policy."limit" IS 'units per window, or the token bucket''s refill per window';
COMMENT ON COLUMN pgrl_policy."window" IS 'window length or refill period: 1 millisecond to 366 days, no months';
COMMENT ON COLUMN pgrl_policy.burst IS 'token bucket capacity; NULL means the limit';
COMMENT ON COLUMN pgrl_policy.key_mode IS
    'how keys are stored in the counters and in pgrl_policy_override.key: hashed or readable';

CREATE TABLE pgrl_policy_override (
    policy     text        NOT NULL,
    key        bytea       NOT NULL,
    "limit"    bigint,
    "window"   interval,
    burst      bigint,
    expires_at timestamptz,
    note       text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pgrl_policy_override_pkey PRIMARY KEY (policy, key),
    CONSTRAINT pgrl_policy_override_policy_fkey FOREIGN KEY (policy)
        REFERENCES pgrl_policy (name) ON DELETE CASCADE ON UPDATE CASCADE,
    CONSTRAINT pgrl_policy_override_key_check CHECK (octet_length(key) BETWEEN 1 AND 2305),
    CONSTRAINT pgrl_policy_override_limit_check CHECK ("limit" > 0),
    CONSTRAINT pgrl_policy_override_window_check
        CHECK (extract(year FROM "window") = 0 AND extract(month FROM "window") = 0
               AND "window" >= interval '1 millisecond' AND "window" <= interval '366 days'),
    CONSTRAINT pgrl_policy_override_burst_check CHECK (burst > 0 AND burst <= 9007199254740992),
    CONSTRAINT pgrl_policy_override_something_check
        CHECK ("limit" IS NOT NULL OR "window" IS NOT NULL OR burst IS NOT NULL),
    CONSTRAINT pgrl_policy_override_note_check CHECK (length(note) <= 1000)
);

COMMENT ON TABLE pgrl_policy_override IS 'pgrl per-key overrides of a policy''s limit, window or burst';
COMMENT ON COLUMN pgrl_policy_override.key IS
    'the key as the counters store it: pgrl_stored_key(policy, key, key_mode = ''readable'')';
COMMENT ON COLUMN pgrl_policy_override."limit" IS 'NULL inherits the policy''s';
COMMENT ON COLUMN pgrl_policy_override.expires_at IS 'the override stops applying at this instant; NULL: never';

-- pgrl_stored_key is ratelimit.StoredKey in SQL: the bytes the counters (and
-- pgrl_policy_override.key) hold for a caller's key under a limiter named
-- name. Readable: name || ':' || key. Hashed (the default): the first 16
-- bytes of SHA-256(uvarint(byte length of name) || name || key), names and
-- keys in UTF-8.
CREATE FUNCTION pgrl_stored_key(name text, key text, readable boolean DEFAULT false) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    n   bytea := convert_to(name, 'UTF8');
    k   bytea := convert_to(key, 'UTF8');
    len bigint := octet_length(convert_to(name, 'UTF8'));
    pre bytea := ''::bytea;
BEGIN
    IF readable THEN
        RETURN n || convert_to(':', 'UTF8') || k;
    END IF;
    WHILE len >= 128 LOOP
        pre := pre || set_byte(decode('00', 'hex'), 0, ((len % 128) + 128)::int);
        len := len / 128;
    END LOOP;
    pre := pre || set_byte(decode('00', 'hex'), 0, len::int);
    RETURN substring(sha256(pre || n || k) FROM 1 FOR 16);
END
$$;

-- pgrl_policy_touch keeps updated_at current on every UPDATE.
CREATE FUNCTION pgrl_policy_touch() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

-- pgrl_policy_keep_key_mode refuses to change the key mode of a policy that
-- has overrides: their keys are stored in the old mode and would no longer
-- match any key.
CREATE FUNCTION pgrl_policy_keep_key_mode() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF NEW.key_mode IS DISTINCT FROM OLD.key_mode
       AND EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = OLD.name) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_key_mode_overrides_check',
            MESSAGE = format('policy %s has overrides, whose keys are stored in key mode %s', OLD.name, OLD.key_mode),
            HINT = 'delete its overrides first, change the key mode, then set them again';
    END IF;
    RETURN NEW;
END
$$;

-- pgrl_policy_notify sends the change of a row of either table on channel
-- 'pgrl_policy' (for an override, with its key). NOTIFY drops identical
-- payloads within one transaction. A change that moves a row (a renamed
-- policy, an override given another key) sends both the old and the new.
CREATE FUNCTION pgrl_policy_notify() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    old_name text;
    new_name text;
    old_key  text;
    new_key  text;
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        PERFORM pg_notify('pgrl_policy', json_build_object(
            'schema', TG_TABLE_SCHEMA, 'table', TG_TABLE_NAME, 'op', TG_OP, 'policy', NULL)::text);
        RETURN NULL;
    END IF;
    IF TG_TABLE_NAME = 'pgrl_policy' THEN
        IF TG_OP <> 'INSERT' THEN old_name := OLD.name; END IF;
        IF TG_OP <> 'DELETE' THEN new_name := NEW.name; END IF;
    ELSE
        IF TG_OP <> 'INSERT' THEN old_name := OLD.policy; old_key := encode(OLD.key, 'hex'); END IF;
        IF TG_OP <> 'DELETE' THEN new_name := NEW.policy; new_key := encode(NEW.key, 'hex'); END IF;
    END IF;
    IF old_name IS NOT NULL AND (old_name IS DISTINCT FROM new_name OR old_key IS DISTINCT FROM new_key) THEN
        PERFORM pg_notify('pgrl_policy', json_strip_nulls(json_build_object(
            'schema', TG_TABLE_SCHEMA, 'table', TG_TABLE_NAME, 'op', TG_OP,
            'policy', old_name, 'key', old_key))::text);
    END IF;
    IF new_name IS NOT NULL THEN
        PERFORM pg_notify('pgrl_policy', json_strip_nulls(json_build_object(
            'schema', TG_TABLE_SCHEMA, 'table', TG_TABLE_NAME, 'op', TG_OP,
            'policy', new_name, 'key', new_key))::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER pgrl_policy_touch BEFORE UPDATE ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_touch();
CREATE TRIGGER pgrl_policy_keep_key_mode BEFORE UPDATE OF key_mode ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_keep_key_mode();
CREATE TRIGGER pgrl_policy_override_touch BEFORE UPDATE ON pgrl_policy_override
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_touch();
CREATE TRIGGER pgrl_policy_notify AFTER INSERT OR UPDATE OR DELETE ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_notify();
CREATE TRIGGER pgrl_policy_override_notify AFTER INSERT OR UPDATE OR DELETE ON pgrl_policy_override
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_notify();
CREATE TRIGGER pgrl_policy_truncate AFTER TRUNCATE ON pgrl_policy
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_notify();
CREATE TRIGGER pgrl_policy_override_truncate AFTER TRUNCATE ON pgrl_policy_override
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_notify();
