DROP TRIGGER IF EXISTS pgrl_policy_override_flag_truncate ON pgrl_policy_override;
DROP TRIGGER IF EXISTS pgrl_policy_override_flag_delete ON pgrl_policy_override;
DROP TRIGGER IF EXISTS pgrl_policy_override_flag_update ON pgrl_policy_override;
DROP TRIGGER IF EXISTS pgrl_policy_override_flag_insert ON pgrl_policy_override;
DROP FUNCTION IF EXISTS pgrl_policy_override_flag();
DROP TRIGGER IF EXISTS pgrl_policy_has_overrides ON pgrl_policy;
DROP FUNCTION IF EXISTS pgrl_policy_has_overrides();

DROP TRIGGER IF EXISTS pgrl_policy_notify ON pgrl_policy;
CREATE TRIGGER pgrl_policy_notify AFTER INSERT OR UPDATE OR DELETE ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_notify();
DROP TRIGGER IF EXISTS pgrl_policy_touch ON pgrl_policy;
CREATE TRIGGER pgrl_policy_touch BEFORE UPDATE ON pgrl_policy
    FOR EACH ROW EXECUTE FUNCTION pgrl_policy_touch();

ALTER TABLE pgrl_policy DROP COLUMN IF EXISTS has_overrides;
