-- Drops the policy figures of the counter rows. pgrl_fixed_window_set_layout
-- stays as migration 000013 made it: it copies whatever columns the table
-- has, so it serves the table without them as well.
ALTER TABLE pgrl_token_bucket DROP COLUMN policy_penalty, DROP COLUMN policy_burst,
                              DROP COLUMN policy_window_us, DROP COLUMN policy_limit;
ALTER TABLE pgrl_sliding_window DROP COLUMN policy_penalty, DROP COLUMN policy_limit;
ALTER TABLE pgrl_fixed_window DROP COLUMN policy_penalty, DROP COLUMN policy_limit;
