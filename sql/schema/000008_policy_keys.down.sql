-- Reverts 000008: overrides' keys are no longer checked against their
-- policy's key mode, pgrl_policy_key is gone, and the policy trigger keeps
-- the key mode only, as 000007 made it. No row is changed.
DROP TRIGGER IF EXISTS pgrl_policy_override_key_mode_check ON pgrl_policy_override;
DROP FUNCTION IF EXISTS pgrl_policy_override_check_key();
DROP FUNCTION IF EXISTS pgrl_policy_key(text, text);

CREATE OR REPLACE FUNCTION pgrl_policy_keep_key_mode() RETURNS trigger
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

DROP TRIGGER IF EXISTS pgrl_policy_keep_key_mode ON pgrl_policy;
CREATE TRIGGER pgrl_policy_keep_key_mode BEFORE UPDATE OF key_mode ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_keep_key_mode();

COMMENT ON COLUMN pgrl_policy_override.key IS
    'the key as the counters store it: pgrl_stored_key(policy, key, key_mode = ''readable'')';
