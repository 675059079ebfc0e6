-- An override's key must be one that a check can look up: the stored form of
-- a caller's key under the policy's key mode. Before this migration the
-- table took any bytes, so a plain-SQL override written with the caller's
-- key itself (VALUES ('api', 'tenant-9', 5)) was accepted and never applied.
--
-- pgrl_policy_key(policy, key) writes the stored form in SQL, in the key mode
-- the policy has:
--   INSERT INTO pgrl_policy_override (policy, key, "limit")
--   VALUES ('api', pgrl_policy_key('api', 'tenant-9'), 5);
--
-- The constraint trigger pgrl_policy_override_key_mode_check refuses, on
-- every INSERT and on every UPDATE of policy or key, a key that cannot be a
-- stored key of the policy: under hashed keys anything but 16 bytes (a
-- digest), under readable keys anything that does not start with the
-- policy's name and ':'. A 16-byte caller's key under hashed keys cannot be
-- told from a digest; write every key with pgrl_policy_key.
--
-- An override's key is bound to its policy's name and key mode, so the
-- trigger of 000007 that keeps the key mode of a policy with overrides now
-- also keeps its name: a renamed policy's overrides (which ON UPDATE CASCADE
-- would carry along) would never match again. It also locks the override
-- table against concurrent writers while it looks, so that an override
-- written during the change is checked against the new key mode.
--
-- These three functions run with the search_path they were created with
-- (pgrl's schema, as 000004's do), so that they find pgrl's tables whatever
-- the caller's search_path: a DBA may write
--   INSERT INTO ratelimit.pgrl_policy_override ... ratelimit.pgrl_policy_key(...)
-- from a session whose search_path does not name the schema.
--
-- Rows already in the table are left as they are (an override that never
-- applied goes on not applying); docs/POLICIES.md has the query that finds
-- and rewrites them.

-- pgrl_policy_key is the key as pgrl_policy_override.key stores it under the
-- policy named policy: pgrl_stored_key(policy, key, key_mode = 'readable').
CREATE FUNCTION pgrl_policy_key(policy text, key text) RETURNS bytea
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE
SET search_path FROM CURRENT
AS $$
DECLARE
    mode text;
BEGIN
    SELECT p.key_mode INTO mode FROM pgrl_policy AS p WHERE p.name = policy;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'pgrl_policy_override_policy_fkey',
            MESSAGE = format('pgrl_policy_key: no policy is named %s', policy),
            HINT = 'create the policy first (INSERT INTO pgrl_policy, or rl-policy set)';
    END IF;
    RETURN pgrl_stored_key(policy, key, mode = 'readable');
END
$$;

-- pgrl_policy_override_check_key refuses an override whose key cannot be a
-- stored key under its policy's key mode.
CREATE FUNCTION pgrl_policy_override_check_key() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    mode   text;
    prefix bytea;
BEGIN
    SELECT p.key_mode INTO mode FROM pgrl_policy AS p WHERE p.name = NEW.policy;
    IF NOT FOUND THEN
        RETURN NULL; -- the foreign key refuses it
    END IF;
    IF mode = 'readable' THEN
        prefix := convert_to(NEW.policy || ':', 'UTF8');
        IF substring(NEW.key FROM 1 FOR octet_length(prefix)) = prefix THEN
            RETURN NULL;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_override_key_mode_check',
            MESSAGE = format('the key of an override of policy %s, whose keys are readable, must start with %L: '
                             'it is not a stored key, and would never apply', NEW.policy, NEW.policy || ':'),
            HINT = format('write the key as pgrl_policy_key(%L, ''the key'')', NEW.policy);
    ELSIF octet_length(NEW.key) <> 16 THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_override_key_mode_check',
            MESSAGE = format('the key of an override of policy %s, whose keys are hashed, must be a 16-byte digest, '
                             'not %s bytes: it is not a stored key, and would never apply',
                             NEW.policy, octet_length(NEW.key)),
            HINT = format('write the key as pgrl_policy_key(%L, ''the key'')', NEW.policy);
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER pgrl_policy_override_key_mode_check
    AFTER INSERT OR UPDATE OF policy, key ON pgrl_policy_override
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_override_check_key();

-- pgrl_policy_keep_key_mode now keeps the name too, and waits for the
-- writers of overrides before it looks.
CREATE OR REPLACE FUNCTION pgrl_policy_keep_key_mode() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NEW.key_mode IS NOT DISTINCT FROM OLD.key_mode AND NEW.name IS NOT DISTINCT FROM OLD.name THEN
        RETURN NEW;
    END IF;
    LOCK TABLE pgrl_policy_override IN SHARE ROW EXCLUSIVE MODE;
    IF NOT EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = OLD.name) THEN
        RETURN NEW;
    END IF;
    IF NEW.key_mode IS DISTINCT FROM OLD.key_mode THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_key_mode_overrides_check',
            MESSAGE = format('policy %s has overrides, whose keys are stored in key mode %s', OLD.name, OLD.key_mode),
            HINT = 'delete its overrides first, change the key mode, then set them again';
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_name_overrides_check',
        MESSAGE = format('policy %s has overrides, whose keys are stored under its name', OLD.name),
        HINT = 'create a policy of the new name and set its overrides there (pgrl_policy_key), then delete this one';
END
$$;

DROP TRIGGER pgrl_policy_keep_key_mode ON pgrl_policy;
CREATE TRIGGER pgrl_policy_keep_key_mode BEFORE UPDATE OF key_mode, name ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_keep_key_mode();

COMMENT ON COLUMN pgrl_policy_override.key IS
    'the key as the counters store it: pgrl_policy_key(policy, key), '
    'that is pgrl_stored_key(policy, key, key_mode = ''readable'')';
