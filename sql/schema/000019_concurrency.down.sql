DROP TABLE IF EXISTS pgrl_concurrency;
DROP FUNCTION IF EXISTS pgrl_concurrency_tokens(pgrl_slot[], bigint, bytea);
DROP FUNCTION IF EXISTS pgrl_concurrency_last_us(pgrl_slot[], bigint);
DROP FUNCTION IF EXISTS pgrl_concurrency_next_us(pgrl_slot[], bigint);
DROP FUNCTION IF EXISTS pgrl_concurrency_held(pgrl_slot[], bigint);
DROP FUNCTION IF EXISTS pgrl_concurrency_holds(pgrl_slot[], bigint, bytea);
DROP FUNCTION IF EXISTS pgrl_concurrency_renew(pgrl_slot[], bigint, pgrl_slot[]);
DROP FUNCTION IF EXISTS pgrl_concurrency_step(pgrl_slot[], bigint, bytea, bigint, bigint);
DROP TYPE IF EXISTS pgrl_slot;
