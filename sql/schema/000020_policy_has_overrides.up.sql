-- Whether a policy has overrides, kept on its row.
--
-- A check that reads its stored policy in its statement reads the key's
-- override too: a second index probe, and a second table in the statement's
-- plan, which costs about as much again as the probe itself even when the
-- probe finds nothing (opening and locking the table and its index on every
-- execution). Most policies have no override at all. With
-- pgrl_policy.has_overrides, the library sends, for such a policy, the plain
-- statement of its algorithm guarded by the policy's row alone: it counts only
-- when the row still holds the figures the library sent and has_overrides is
-- false (…TakeUnderPolicy in sql/internal), and otherwise counts nothing, so
-- the library sends the statement that reads the override.
--
-- has_overrides is true exactly when pgrl_policy_override has a row of the
-- policy (an expired one too). Nobody writes it but the triggers below:
--   * after every INSERT, UPDATE, DELETE or TRUNCATE statement on
--     pgrl_policy_override, the rows of the policies it touched are locked
--     and, where the flag is wrong, updated, and
--   * pgrl_policy_has_overrides, BEFORE UPDATE OF has_overrides, sets the
--     value from the override table, whatever the UPDATE asked for.
-- The first reads the override table with a snapshot taken once it holds
-- the policies' rows (a trigger function's statements each take one), so
-- that of two transactions that write overrides of one policy at once, the
-- one that commits last sees the other's rows too; and the override rows
-- and the flag commit together, so that every snapshot sees them agree.
--
-- The touch and notify triggers of pgrl_policy (000007) are made to fire on
-- an UPDATE of the policy's own columns only, so that the flag's upkeep
-- neither changes a policy's updated_at nor sends a notification of its own
-- (the override's notification names the change). A migration that adds a
-- column to pgrl_policy adds it to those two lists.

ALTER TABLE pgrl_policy ADD COLUMN has_overrides boolean NOT NULL DEFAULT false;

COMMENT ON COLUMN pgrl_policy.has_overrides IS
    'whether pgrl_policy_override has a row of this policy; kept by triggers (migration 000020), not written by hand';

DROP TRIGGER pgrl_policy_touch ON pgrl_policy;
CREATE TRIGGER pgrl_policy_touch
    BEFORE UPDATE OF name, algorithm, "limit", "window", burst, penalty, key_mode, description, created_at,
                     updated_at ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_touch();
DROP TRIGGER pgrl_policy_notify ON pgrl_policy;
CREATE TRIGGER pgrl_policy_notify
    AFTER INSERT OR DELETE OR UPDATE OF name, algorithm, "limit", "window", burst, penalty, key_mode, description,
                                        created_at, updated_at ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_notify();

-- pgrl_policy_has_overrides sets has_overrides from the override table.
CREATE FUNCTION pgrl_policy_has_overrides() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    NEW.has_overrides := EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = NEW.name);
    RETURN NEW;
END
$$;

CREATE TRIGGER pgrl_policy_has_overrides BEFORE UPDATE OF has_overrides ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_has_overrides();

-- pgrl_policy_override_flag updates has_overrides of the policies whose
-- overrides a statement inserted, updated, deleted or truncated. It locks
-- their rows first (in name order), then, with a snapshot taken once they
-- are held, updates only the rows whose flag is wrong: most writes of
-- overrides leave the flag as it is, and then the policy's row gets no new
-- version (a check reads that row, and walks its dead versions until a
-- vacuum). It runs as its owner (the migration role), so that a role
-- granted DML on the override table alone may still write overrides.
CREATE FUNCTION pgrl_policy_override_flag() RETURNS trigger
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
        SELECT array_agg(DISTINCT c.policy) INTO touched
          FROM (SELECT n.policy FROM pgrl_override_new AS n UNION SELECT o.policy FROM pgrl_override_old AS o) AS c;
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
    -- writers this one waited for committed.
    UPDATE pgrl_policy AS p SET has_overrides = NOT p.has_overrides
     WHERE p.name = ANY (touched)
       AND p.has_overrides IS DISTINCT FROM EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = p.name);
    RETURN NULL;
END
$$;

CREATE TRIGGER pgrl_policy_override_flag_insert AFTER INSERT ON pgrl_policy_override
    REFERENCING NEW TABLE AS pgrl_override_new
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_override_flag();
CREATE TRIGGER pgrl_policy_override_flag_update AFTER UPDATE ON pgrl_policy_override
    REFERENCING OLD TABLE AS pgrl_override_old NEW TABLE AS pgrl_override_new
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_override_flag();
CREATE TRIGGER pgrl_policy_override_flag_delete AFTER DELETE ON pgrl_policy_override
    REFERENCING OLD TABLE AS pgrl_override_old
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_override_flag();
CREATE TRIGGER pgrl_policy_override_flag_truncate AFTER TRUNCATE ON pgrl_policy_override
    FOR EACH STATEMENT EXECUTE FUNCTION pgrl_policy_override_flag();

UPDATE pgrl_policy SET has_overrides = true
 WHERE name IN (SELECT o.policy FROM pgrl_policy_override AS o);
