-- pgrl counter tables.
--
-- All three are UNLOGGED: rate-limit counters are short-lived, so they skip the
-- write-ahead log (no WAL, no fsync on commit). The price: PostgreSQL truncates
-- them after a crash and they are not readable on a standby, so limits start
-- afresh after a crash or a failover.
--
-- fillfactor 50 leaves room on every page so that each check's UPDATE can be a
-- HOT update (the new row version stays on the same page and no index is
-- touched). No column that a check updates is indexed: only the primary key is,
-- and a check never changes it.
--
-- The autovacuum settings suit small, hot tables whose rows churn: vacuum after
-- a small fraction of dead rows, and do not throttle it.
--
-- key is a fixed-size digest of the limiter's name and the caller's key (unless
-- the limiter opts out of hashing): never the raw identifier.

-- Fixed window: one row per key per window. expires_at is the end of the
-- window, so a row is dead once expires_at has passed. It is also the
-- partition key in the partitioned layout: a partition whose range lies in
-- the past holds only dead rows, whatever the window length.
CREATE UNLOGGED TABLE pgrl_fixed_window (
    key        bytea       NOT NULL,
    expires_at timestamptz NOT NULL,
    count      bigint      NOT NULL,
    allowed    boolean     NOT NULL,
    CONSTRAINT pgrl_fixed_window_pkey PRIMARY KEY (key, expires_at)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

COMMENT ON TABLE pgrl_fixed_window IS 'pgrl fixed-window counters: one row per key per window';
COMMENT ON COLUMN pgrl_fixed_window.key IS 'digest of limiter name and key (or the readable key when hashing is off)';
COMMENT ON COLUMN pgrl_fixed_window.expires_at IS 'end of the window; the row is dead after it';
COMMENT ON COLUMN pgrl_fixed_window.count IS 'units counted in this window';
COMMENT ON COLUMN pgrl_fixed_window.allowed IS 'outcome of the last check on this row';

-- Token bucket: one row per key. tokens is the balance at updated_at; refill
-- is computed on each check. full_at is when the bucket is full again if no
-- check touches it, after which the row carries no information and cleanup
-- may delete it.
CREATE UNLOGGED TABLE pgrl_token_bucket (
    key        bytea            NOT NULL,
    tokens     double precision NOT NULL,
    updated_at timestamptz      NOT NULL,
    full_at    timestamptz      NOT NULL,
    allowed    boolean          NOT NULL,
    CONSTRAINT pgrl_token_bucket_pkey PRIMARY KEY (key)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

COMMENT ON TABLE pgrl_token_bucket IS 'pgrl token buckets: one row per key';
COMMENT ON COLUMN pgrl_token_bucket.tokens IS 'balance at updated_at (negative after penalties)';
COMMENT ON COLUMN pgrl_token_bucket.full_at IS 'when the bucket is full again if untouched; the row is dead after it';

-- Sliding window counter: one row per key holding the current window's count
-- and the previous window's count. A check rolls the row forward when a new
-- window starts. expires_at is two windows after window_start: past it both
-- counts are irrelevant.
CREATE UNLOGGED TABLE pgrl_sliding_window (
    key          bytea       NOT NULL,
    window_start timestamptz NOT NULL,
    count        bigint      NOT NULL,
    prev_count   bigint      NOT NULL,
    expires_at   timestamptz NOT NULL,
    allowed      boolean     NOT NULL,
    CONSTRAINT pgrl_sliding_window_pkey PRIMARY KEY (key)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

COMMENT ON TABLE pgrl_sliding_window IS 'pgrl sliding-window counters: one row per key';
COMMENT ON COLUMN pgrl_sliding_window.window_start IS 'start of the current window';
COMMENT ON COLUMN pgrl_sliding_window.count IS 'units counted in the current window';
COMMENT ON COLUMN pgrl_sliding_window.prev_count IS 'units counted in the window before it';
COMMENT ON COLUMN pgrl_sliding_window.expires_at IS 'two windows after window_start; the row is dead after it';
