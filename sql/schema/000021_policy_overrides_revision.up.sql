-- Which keys of a policy have overrides, known to the library by revision.
--
-- Migration 000020 lets a check of a policy without any override read the
-- policy's row alone. A policy with overrides still made every check read
-- the override table, although almost every key has no override: that
-- second table in the statement's plan costs about as much as the check's
-- own counting. pgrl_policy.overrides_revision names the set of keys the
-- policy's overrides have: a limiter reads the revision and the keys once,
-- in one statement, and from then on sends, for a key outside that set, the
-- statement that reads the policy's row alone, guarded by the revision
-- (…TakeUnderPolicy in sql/internal): it counts only while the row still
-- holds that revision, so while no override was added or removed. Any other
-- statement sees another revision, counts nothing, and the library reads
-- the keys again and sends the statement that reads the key's override.
--
-- A revision is a value of the sequence pgrl_policy_revision, so no two
-- sets of keys ever share one, not even those of a policy deleted and made
-- again under its name. Nobody writes it but the triggers below:
--   * pgrl_policy_override_columns, BEFORE INSERT and BEFORE UPDATE OF
--     has_overrides or overrides_revision on pgrl_policy, gives a new row a
--     fresh revision and a changed revision a fresh value (whatever the
--     statement asked for), and sets has_overrides from the override table,
--     as pgrl_policy_has_overrides did;
--   * pgrl_policy_override_flag (000020), after each statement on
--     pgrl_policy_override, now changes the revision of every policy whose
--     set of keys the statement changed (an insert, a delete, or an update
--     of a key or of the policy it belongs to; an update of an override's
--     figures alone changes no set and leaves the policy's row as it is).
-- The policy's row gets a new version for each such statement. The touch
-- and notify triggers of pgrl_policy still fire on the policy's own columns
-- only (000020), so the revision's upkeep neither changes updated_at nor
-- sends a notification of its own.

CREATE SEQUENCE pgrl_policy_revision AS bigint;

ALTER TABLE pgrl_policy ADD COLUMN overrides_revision bigint NOT NULL DEFAULT 0;

COMMENT ON COLUMN pgrl_policy.overrides_revision IS
    'names the set of keys this policy''s overrides have; kept by triggers (migration 000021), not written by hand';

UPDATE pgrl_policy SET overrides_revision = nextval('pgrl_policy_revision');

-- pgrl_policy_override_columns sets has_overrides and overrides_revision.
-- It runs as its owner, so that a role allowed to write policies needs no
-- privilege on the sequence.
CREATE FUNCTION pgrl_policy_override_columns() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    NEW.has_overrides := EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = NEW.name);
    IF TG_OP = 'INSERT' OR NEW.overrides_revision IS DISTINCT FROM OLD.overrides_revision THEN
        NEW.overrides_revision := nextval('pgrl_policy_revision');
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER pgrl_policy_has_overrides ON pgrl_policy;
DROP FUNCTION pgrl_policy_has_overrides();
CREATE TRIGGER pgrl_policy_override_columns BEFORE INSERT OR UPDATE OF has_overrides, overrides_revision ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_override_columns();

-- pgrl_policy_override_flag changes the revision (and so sets has_overrides)
-- of the policies whose set of override keys a statement changed. It locks
-- their rows first (in name order), then, in a statement of its own (so with
-- a snapshot taken once they are held), updates them: of two transactions
-- that write overrides of one policy at once, the one that commits last
-- sees the other's rows when it sets has_overrides.
CREATE OR REPLACE FUNCTION pgrl_policy_override_flag() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    touched text[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT array_agg(DISTINCT n.policy) INTO touched FROM pgrl_override_new AS n;
    ELSIF TG_OP = 'UPDATE' THEN
        -- The policies of the (policy, key) pairs found on one side only.
        SELECT array_agg(DISTINCT c.policy) INTO touched
          FROM ((SELECT n.policy, n.key FROM pgrl_override_new AS n
                 EXCEPT ALL SELECT o.policy, o.key FROM pgrl_override_old AS o)
                UNION ALL
                (SELECT o.policy, o.key FROM pgrl_override_old AS o
                 EXCEPT ALL SELECT n.policy, n.key FROM pgrl_override_new AS n)) AS c;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT array_agg(DISTINCT o.policy) INTO touched FROM pgrl_override_old AS o;
    ELSE
        SELECT array_agg(p.name) INTO touched FROM pgrl_policy AS p WHERE p.has_overrides;
    END IF;
    IF touched IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM FROM pgrl_policy AS p WHERE p.name = ANY (touched) ORDER BY p.name FOR NO KEY UPDATE;
    -- A statement of its own, so a snapshot of its own: it sees what the
    -- writers this one waited for committed. pgrl_policy_override_columns
    -- makes the changed revision a fresh one and sets has_overrides.
    UPDATE pgrl_policy AS p SET overrides_revision = p.overrides_revision + 1, has_overrides = p.has_overrides
     WHERE p.name = ANY (touched);
    RETURN NULL;
END
$$;
