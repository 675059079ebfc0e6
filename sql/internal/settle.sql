-- The statements of a reservation's settlement (ratelimit.Limiter.Settle).
-- A reservation is a check with a request id (reserve_id): its answer, with
-- the units it was granted, is stored in pgrl_request (migration 000017).
-- Its settlement is stored beside it under a second id (settle_id), in the
-- transaction that refunds or charges the difference, so that a settlement
-- is made once: a second one finds the first's row and changes nothing.

-- name: SettleClaim :one
-- SettleClaim finds the reservation reserve_id of key and claims its
-- settlement: it stores a row under settle_id (its result filled in by
-- SettleRecord before the transaction commits), kept as long as the
-- reservation's answer. claimed is false when the reservation has lapsed
-- (its expires_at has passed at at, or now) or a settlement was stored
-- already: a concurrent one waits here for the first to commit, then finds
-- its row. No row when the reservation is not stored.
WITH res AS (
    SELECT r.result, r.expires_at FROM pgrl_request AS r WHERE r.key = @key::bytea AND r.id = @reserve_id::bytea
), claim AS (
    INSERT INTO pgrl_request (key, id, expires_at, result)
    SELECT @key::bytea, @settle_id::bytea, res.expires_at, 'null'::jsonb
      FROM res
     WHERE res.expires_at > coalesce(sqlc.narg(at)::timestamptz, now())
    ON CONFLICT (key, id) DO NOTHING
    RETURNING true AS claimed
)
SELECT res.result::jsonb AS result, pgrl_us(res.expires_at)::bigint AS expires_at_us,
       pgrl_us(coalesce(sqlc.narg(at)::timestamptz, now()))::bigint AS now_us,
       EXISTS (SELECT FROM claim)::boolean AS claimed
  FROM res;

-- name: SettleRead :one
-- SettleRead returns the settlement stored under settle_id of key.
SELECT r.result::jsonb AS result FROM pgrl_request AS r WHERE r.key = @key::bytea AND r.id = @settle_id::bytea;

-- name: SettleRecord :execrows
-- SettleRecord fills in the settlement that SettleClaim claimed.
UPDATE pgrl_request AS r SET result = @result::jsonb WHERE r.key = @key::bytea AND r.id = @settle_id::bytea;
