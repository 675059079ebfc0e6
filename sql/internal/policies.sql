-- name: PolicyOverrideKeys :one
-- PolicyOverrideKeys reads the overrides_revision of the stored policy
-- named policy (migration 000021) and the stored keys its overrides have at
-- that revision (expired ones too), in one statement, hence one snapshot:
-- a key outside them has no override for as long as the policy's row holds
-- that revision, so the caller may check it with …TakeUnderPolicy. At most
-- max_keys + 1 keys come back: more than max_keys means the caller should
-- not hold them. No row comes back when the policy does not exist.
SELECT p.overrides_revision::bigint AS overrides_revision,
       ARRAY(SELECT o.key FROM pgrl_policy_override AS o WHERE o.policy = p.name
              LIMIT sqlc.arg(max_keys)::integer + 1)::bytea[] AS keys
  FROM pgrl_policy AS p
 WHERE p.name = sqlc.arg(policy)::text;
