DROP TRIGGER IF EXISTS pgrl_policy_override_columns ON pgrl_policy;
DROP FUNCTION IF EXISTS pgrl_policy_override_columns();

-- Migration 000020's functions and trigger, as it made them.
CREATE OR REPLACE FUNCTION pgrl_policy_has_overrides() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    NEW.has_overrides := EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = NEW.name);
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS pgrl_policy_has_overrides ON pgrl_policy;
CREATE TRIGGER pgrl_policy_has_overrides BEFORE UPDATE OF has_overrides ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_has_overrides();

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

ALTER TABLE pgrl_policy DROP COLUMN IF EXISTS overrides_revision;
DROP SEQUENCE IF EXISTS pgrl_policy_revision;
