-- Request ids: a check that carries one (ratelimit.RequestID) counts once.
--
-- A retried request (a client that timed out, a proxy that replayed it, a
-- second instance that picked up the same job) must not be charged twice.
-- The statement that decides a check with a request id also stores its
-- answer here, in the same transaction, under the key's stored key and the
-- id's hash: a check whose id is stored returns that answer and counts
-- nothing; two checks of one id at once find each other through the
-- primary key (the second waits for the first to commit, then fails with
-- unique_violation and is asked again, finding the answer). So the answer
-- and the units it counted commit together or not at all.
--
-- Not the counters' hot rows: one row per request, in a table of its own.
-- UNLOGGED as the counters are (a crash forgets the ids with the counts).
-- Rows are kept until expires_at, the limiter's retention (its window), and
-- deleted afterwards by rl-cleanup and by opportunistic cleanup; until then
-- a retry is answered from them even past expires_at.
CREATE UNLOGGED TABLE pgrl_request (
    key        bytea       NOT NULL,
    id         bytea       NOT NULL,
    expires_at timestamptz NOT NULL,
    -- result is the rows the check's statement returned, as a JSON array.
    result     jsonb       NOT NULL,
    PRIMARY KEY (key, id),
    CONSTRAINT pgrl_request_id_length CHECK (octet_length(id) = 16)
);

-- Rows arrive in about the order they expire: a BRIN index finds the
-- expired ones for rl-cleanup, and is smaller and cheaper to keep up than a
-- B-tree.
CREATE INDEX pgrl_request_expires_at ON pgrl_request USING brin (expires_at);

-- A role that may check or clean up the counters may do the same here:
-- each privilege granted on pgrl_sliding_window (the table every check and
-- every cleanup run writes or reads since migration 000001) is granted on
-- pgrl_request too, so that an application role or a cleanup role set up
-- before this migration keeps working after it.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT a.grantee, r.rolname, a.privilege_type
               FROM pg_catalog.pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
               LEFT JOIN pg_catalog.pg_roles AS r ON r.oid = a.grantee
              WHERE c.oid = 'pgrl_sliding_window'::regclass AND a.grantee <> c.relowner
                AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE') LOOP
        IF g.grantee = 0 THEN
            EXECUTE format('GRANT %s ON pgrl_request TO PUBLIC', g.privilege_type);
        ELSE
            EXECUTE format('GRANT %s ON pgrl_request TO %I', g.privilege_type, g.rolname);
        END IF;
    END LOOP;
END
$$;
