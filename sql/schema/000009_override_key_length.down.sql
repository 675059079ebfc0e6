-- Reverts 000009: pgrl_policy_override_check_key is 000008's again, which
-- checks a readable key's prefix but not its length. No row is changed.
CREATE OR REPLACE FUNCTION pgrl_policy_override_check_key() RETURNS trigger
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
