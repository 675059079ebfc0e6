-- name: MultiRequireAllowed :one
-- MultiRequireAllowed ends a multi-limit batch that must be all-or-nothing:
-- it reads back the outcome of the checks the batch just made (each row's
-- allowed column, written by this transaction and still locked by it) and
-- raises SQLSTATE PGRL1 unless every one was allowed, which rolls the whole
-- batch back. Fixed-window rows are found by their window, computed from
-- now() as the checks computed it (floored, also before 1970), or from at_us
-- (microseconds since the Unix epoch) when the checks' clock was pinned: in
-- one transaction, now() is the same instant for every statement.
SELECT pgrl_abort_unless(
           coalesce(bool_and(a.allowed), true)
           AND count(*) = coalesce(cardinality(sqlc.arg(fixed_window_keys)::bytea[]), 0)
                        + coalesce(cardinality(sqlc.arg(token_bucket_keys)::bytea[]), 0)
                        + coalesce(cardinality(sqlc.arg(sliding_window_keys)::bytea[]), 0),
           'pgrl: a limit denied the request; nothing was consumed')::boolean AS ok
  FROM (
      SELECT f.allowed
        FROM (SELECT pgrl_epoch_us(coalesce(pgrl_from_epoch_us(sqlc.narg(at_us)::bigint), now())) AS now_us) AS clock
       CROSS JOIN generate_subscripts(sqlc.arg(fixed_window_keys)::bytea[], 1) AS i
        JOIN pgrl_fixed_window AS f
          ON f.key = (sqlc.arg(fixed_window_keys)::bytea[])[i]
         AND f.expires_at = pgrl_from_epoch_us(
                                pgrl_window_end_us(clock.now_us, (sqlc.arg(fixed_window_windows_us)::bigint[])[i]))
      UNION ALL
      SELECT t.allowed FROM pgrl_token_bucket AS t WHERE t.key = ANY(sqlc.arg(token_bucket_keys)::bytea[])
      UNION ALL
      SELECT s.allowed FROM pgrl_sliding_window AS s WHERE s.key = ANY(sqlc.arg(sliding_window_keys)::bytea[])
  ) AS a;
