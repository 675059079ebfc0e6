DROP TABLE IF EXISTS pgrl_sliding_window;
DROP TABLE IF EXISTS pgrl_token_bucket;
DROP TABLE IF EXISTS pgrl_fixed_window;
