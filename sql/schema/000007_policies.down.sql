-- Drops the policy tables of 000007 and their functions. The policies and
-- overrides in them are lost: keep a copy first (rl-policy list --output json,
-- or pg_dump -t pgrl_policy -t pgrl_policy_override).
DROP TABLE IF EXISTS pgrl_policy_override;
DROP TABLE IF EXISTS pgrl_policy;
DROP FUNCTION IF EXISTS pgrl_policy_notify();
DROP FUNCTION IF EXISTS pgrl_policy_keep_key_mode();
DROP FUNCTION IF EXISTS pgrl_policy_touch();
DROP FUNCTION IF EXISTS pgrl_stored_key(text, text, boolean);
