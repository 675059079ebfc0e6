-- name: ConcurrencyAcquire :one
-- ConcurrencyAcquire takes a slot of the key for token, to be held until
-- ttl_us after the check's instant, when fewer than max_held slots are live
-- (migration 000019): one statement on the key's one row, inserted or
-- updated by the upsert's update arm with what the concurrency step
-- (pgrl_concurrency_step) makes of it. allowed says whether token holds a
-- slot afterwards; held counts the live slots; next_us is the earliest
-- lapse of a live slot, last_us the latest (0 when none is held). A
-- token that already holds a slot extends it and takes no other, so a
-- retried acquire is counted once. at pins the clock for tests; production
-- leaves it nil and the database's now() decides. The update arm calls only
-- IMMUTABLE functions and reads the instant from the proposed row
-- (excluded), as Citus requires.
INSERT INTO pgrl_concurrency AS t (key, slots, expires_at, updated_at)
VALUES (sqlc.arg(key)::bytea,
        ARRAY[ROW(sqlc.arg(token)::bytea,
                  pgrl_now_us(sqlc.narg(at)::timestamptz) + sqlc.arg(ttl_us)::bigint)::pgrl_slot],
        pgrl_from_epoch_us(pgrl_now_us(sqlc.narg(at)::timestamptz) + sqlc.arg(ttl_us)::bigint),
        pgrl_now(sqlc.narg(at)::timestamptz))
ON CONFLICT (key) DO UPDATE
   SET slots = pgrl_concurrency_step(t.slots, pgrl_us(excluded.updated_at), sqlc.arg(token)::bytea,
                                     sqlc.arg(ttl_us)::bigint, sqlc.arg(max_held)::bigint),
       expires_at = greatest(t.expires_at, excluded.expires_at),
       updated_at = excluded.updated_at
RETURNING pgrl_concurrency_holds(t.slots, pgrl_us(t.updated_at), sqlc.arg(token)::bytea)::boolean AS allowed,
          pgrl_concurrency_held(t.slots, pgrl_us(t.updated_at))::bigint AS held,
          coalesce(pgrl_concurrency_next_us(t.slots, pgrl_us(t.updated_at)), 0)::bigint AS next_us,
          coalesce(pgrl_concurrency_last_us(t.slots, pgrl_us(t.updated_at)), 0)::bigint AS last_us,
          pgrl_us(t.updated_at)::bigint AS now_us;

-- name: ConcurrencyRelease :execrows
-- ConcurrencyRelease gives back token's slot of the key: one row when the
-- slot was held until then, none when it was not (released before, lapsed,
-- never granted), which changes nothing. Lapsed slots of the key are
-- dropped with it.
UPDATE pgrl_concurrency AS t
   SET slots = pgrl_concurrency_step(t.slots, c.now_us, sqlc.arg(token)::bytea, 0, 0)
  FROM (SELECT pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us) AS c
 WHERE t.key = sqlc.arg(key)::bytea AND pgrl_concurrency_holds(t.slots, c.now_us, sqlc.arg(token)::bytea);

-- name: ConcurrencyRenew :many
-- ConcurrencyRenew extends the slots a process holds: tokens[i] of
-- keys[i], to ttls_us[i] after now, each while it is live (a lapsed slot
-- is never revived: another holder may have its place). One statement per
-- process per interval, whatever the number of slots. It is an upsert whose
-- proposed row per key carries the key's tokens with their ttl in until_us,
-- so that rows are locked in key order (the order of the insert: two
-- processes renewing the same keys never deadlock) and the update arm,
-- which calls only IMMUTABLE functions, reads the instant and the renewals
-- from the proposed row (excluded). A key whose row is gone (reset,
-- cleaned up) gets a row whose slots lapsed at their ttl after the epoch:
-- it holds nothing, and cleanup deletes it. A (key, token) pair must not
-- repeat. Each row returned lists holder's tokens still live in that key:
-- a token missing there is not held (it lapsed: its process renewed too
-- late).
INSERT INTO pgrl_concurrency AS t (key, slots, expires_at, updated_at)
SELECT r.key, array_agg(ROW(r.token, r.ttl_us)::pgrl_slot), c.ts, c.ts
  FROM (SELECT pgrl_now(sqlc.narg(at)::timestamptz) AS ts OFFSET 0) AS c,
       (SELECT (sqlc.arg(keys)::bytea[])[i] AS key, (sqlc.arg(tokens)::bytea[])[i] AS token,
               (sqlc.arg(ttls_us)::bigint[])[i] AS ttl_us
          FROM generate_subscripts(sqlc.arg(keys)::bytea[], 1) AS i) AS r
 GROUP BY r.key, c.ts
 ORDER BY r.key
ON CONFLICT (key) DO UPDATE
   SET slots = pgrl_concurrency_renew(t.slots, pgrl_us(excluded.updated_at), excluded.slots),
       expires_at = greatest(t.expires_at, pgrl_from_epoch_us(pgrl_us(excluded.updated_at)
                                                              + pgrl_concurrency_last_us(excluded.slots, 0))),
       updated_at = excluded.updated_at
RETURNING t.key, pgrl_concurrency_tokens(t.slots, pgrl_us(t.updated_at), sqlc.arg(holder)::bytea)::bytea[] AS tokens;

-- name: ConcurrencyPeek :one
-- ConcurrencyPeek reports the key's live slots without taking one: held,
-- next_us and last_us as ConcurrencyAcquire returns them.
SELECT coalesce(pgrl_concurrency_held(t.slots, c.now_us), 0)::bigint AS held,
       coalesce(pgrl_concurrency_next_us(t.slots, c.now_us), 0)::bigint AS next_us,
       coalesce(pgrl_concurrency_last_us(t.slots, c.now_us), 0)::bigint AS last_us,
       c.now_us::bigint AS now_us
  FROM (SELECT pgrl_now_us(sqlc.narg(at)::timestamptz) AS now_us) AS c
  LEFT JOIN pgrl_concurrency AS t ON t.key = sqlc.arg(key)::bytea;

-- name: ConcurrencyReset :execrows
-- ConcurrencyReset forgets every slot of the key.
DELETE FROM pgrl_concurrency WHERE key = sqlc.arg(key)::bytea;
