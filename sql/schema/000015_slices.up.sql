-- Slices: the partial grant a lease takes (package lease), sized by the
-- statement that grants it.
--
-- A lease answers a key's checks in memory from a slice of the key's quota
-- counted here ahead of use. Only the row knows what is left when the slice
-- is taken, so the row decides its size: a slice asks for up to n units, is
-- granted a fair share of what is left, ceil(left / share) (share being
-- how many holders the lease expects to split the rest), never more than n,
-- never fewer than min (the cost of the check that asked for it), and is
-- denied when fewer than min are left. So slices shrink as the key nears its
-- limit, and the last units go one at a time. Under penalty a denied slice
-- charges min, the attempt of the check that asked, never the ask.
--
-- A slice is decided by composing its algorithm's step (migration 000012):
-- a partial grant of n * share units (the probe) reads what is left, the
-- ask follows from it, and a partial grant of the ask decides. Nothing here
-- computes what a step computes.

-- pgrl_slice_probe is the probe's ask: n * share, at most the largest
-- bigint.
CREATE FUNCTION pgrl_slice_probe(n bigint, share bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(n::numeric * share, 9223372036854775807)::bigint $$;

-- pgrl_slice_ask is a slice's ask, given left (what the probe was granted:
-- the units left, at most n * share): ceil(left / share), at least min and
-- at most n.
CREATE FUNCTION pgrl_slice_ask(left_units bigint, n bigint, min bigint, share bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT least(n, greatest(min, ceil(left_units::numeric / share)::bigint)) $$;

-- pgrl_fixed_window_take_slice takes a slice of key's current window, as
-- pgrl_fixed_window_take_queue takes a check: the row is locked (made when
-- the window is new), the step decides, the row is written.
CREATE FUNCTION pgrl_fixed_window_take_slice(key bytea, n bigint, min bigint, share bigint, max_count bigint,
                                             window_us bigint, penalty boolean, at timestamptz)
RETURNS TABLE (granted bigint, count bigint, allowed boolean, expires_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts      timestamptz := coalesce(at, now());
    now_at  bigint := pgrl_epoch_us(coalesce(at, now()));
    end_us  bigint := pgrl_window_end_us(pgrl_epoch_us(coalesce(at, now())), window_us);
    ends_at timestamptz := pgrl_from_epoch_us(pgrl_window_end_us(pgrl_epoch_us(coalesce(at, now())), window_us));
    cnt     bigint;
    probe   pgrl_fixed_window_step;
    s       pgrl_fixed_window_step;
BEGIN
    SELECT t.count INTO cnt
      FROM pgrl_fixed_window AS t
     WHERE t.key = pgrl_fixed_window_take_slice.key AND t.expires_at = ends_at
       FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO pgrl_fixed_window AS t (key, expires_at, count, allowed, updated_at)
        VALUES (pgrl_fixed_window_take_slice.key, ends_at, 0, true, ts)
        ON CONFLICT (key, expires_at) DO UPDATE SET count = t.count
        RETURNING t.count INTO cnt;
    END IF;
    probe := pgrl_fixed_window_take(end_us, cnt, pgrl_slice_probe(n, share), max_count, false, true);
    s := pgrl_fixed_window_take(end_us, cnt, pgrl_slice_ask(probe.granted, n, min, share), max_count, false, true);
    IF s.granted < min THEN
        s := pgrl_fixed_window_take(end_us, cnt, min, max_count, penalty, false);
    END IF;
    UPDATE pgrl_fixed_window AS t
       SET count = s.count, allowed = s.allowed, updated_at = greatest(t.updated_at, ts)
     WHERE t.key = pgrl_fixed_window_take_slice.key AND t.expires_at = ends_at;
    granted := s.granted; count := s.count; allowed := s.allowed; expires_at_us := end_us; now_us := now_at;
    RETURN NEXT;
END
$$;

-- pgrl_sliding_window_take_slice takes a slice of key's sliding window, as
-- pgrl_sliding_window_take_queue takes a check.
CREATE FUNCTION pgrl_sliding_window_take_slice(key bytea, n bigint, min bigint, share bigint, max_count bigint,
                                               window_us bigint, penalty boolean, at timestamptz)
RETURNS TABLE (granted bigint, window_start_us bigint, count bigint, prev_count bigint, allowed boolean,
               now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    ts     timestamptz := coalesce(at, now());
    now_at bigint := pgrl_epoch_us(coalesce(at, now()));
    starts bigint := pgrl_window_start_us(pgrl_epoch_us(coalesce(at, now())), window_us);
    ws     bigint;
    cur    bigint;
    prev   bigint;
    probe  pgrl_sliding_window_step;
    s      pgrl_sliding_window_step;
BEGIN
    SELECT pgrl_us(t.window_start), t.count, t.prev_count INTO ws, cur, prev
      FROM pgrl_sliding_window AS t
     WHERE t.key = pgrl_sliding_window_take_slice.key
       FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO pgrl_sliding_window AS t (key, window_start, count, prev_count, expires_at, allowed, updated_at)
        VALUES (pgrl_sliding_window_take_slice.key, pgrl_from_epoch_us(starts), 0, 0,
                pgrl_from_epoch_us(starts + 2 * window_us), true, ts)
        ON CONFLICT (key) DO UPDATE SET count = t.count
        RETURNING pgrl_us(t.window_start), t.count, t.prev_count INTO ws, cur, prev;
    END IF;
    probe := pgrl_sliding_window_take(ws, cur, prev, now_at, window_us, pgrl_slice_probe(n, share), max_count,
                                      false, true);
    s := pgrl_sliding_window_take(ws, cur, prev, now_at, window_us, pgrl_slice_ask(probe.granted, n, min, share),
                                  max_count, false, true);
    IF s.granted < min THEN
        s := pgrl_sliding_window_take(ws, cur, prev, now_at, window_us, min, max_count, penalty, false);
    END IF;
    UPDATE pgrl_sliding_window AS t
       SET window_start = pgrl_from_epoch_us(s.window_start_us), count = s.count, prev_count = s.prev_count,
           expires_at = pgrl_from_epoch_us(s.window_start_us + 2 * window_us), allowed = s.allowed,
           updated_at = greatest(t.updated_at, ts)
     WHERE t.key = pgrl_sliding_window_take_slice.key;
    granted := s.granted; window_start_us := s.window_start_us; count := s.count; prev_count := s.prev_count;
    allowed := s.allowed; now_us := now_at;
    RETURN NEXT;
END
$$;
