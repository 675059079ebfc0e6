-- A readable key is stored as the policy's name, ':' and the caller's key,
-- and a check refuses a caller's key of more than 2,048 bytes
-- (ratelimit.MaxReadableKeyBytes) with ErrKeyTooLong. Before this migration
-- an override under readable keys whose stored key held more than that after
-- its "name:" prefix was accepted, and no check could ever reach it.
--
-- pgrl_policy_override_check_key, the function of 000008's constraint
-- trigger pgrl_policy_override_key_mode_check, now also refuses such a key,
-- by the constraint name pgrl_policy_override_key_length_check. The longest
-- key it accepts is the stored form of a caller's key of 2,048 bytes: the
-- longest one a check takes. Hashed keys are checked as before (16 bytes).
--
-- Rows already in the table are left as they are; docs/POLICIES.md has the
-- query that finds the overrides that can never apply.

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
        IF substring(NEW.key FROM 1 FOR octet_length(prefix)) IS DISTINCT FROM prefix THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_override_key_mode_check',
                MESSAGE = format('the key of an override of policy %s, whose keys are readable, must start with %L: '
                                 'it is not a stored key, and would never apply', NEW.policy, NEW.policy || ':'),
                HINT = format('write the key as pgrl_policy_key(%L, ''the key'')', NEW.policy);
        END IF;
        IF octet_length(NEW.key) - octet_length(prefix) > 2048 THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = 'pgrl_policy_override_key_length_check',
                MESSAGE = format('the key of an override of policy %s, whose keys are readable, holds %s bytes '
                                 'after %L: a check refuses keys of more than 2048 bytes, so it would never apply',
                                 NEW.policy, octet_length(NEW.key) - octet_length(prefix), NEW.policy || ':'),
                HINT = 'shorten the key to at most 2048 bytes, or use a policy with hashed keys, '
                       'which take keys of any length';
        END IF;
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
