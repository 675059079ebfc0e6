package policy_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// hasOverrides reads pgrl_policy.has_overrides of policy name, and checks
// it against the override table.
func hasOverrides(t *testing.T, pool *pgxpool.Pool, name string) bool {
	t.Helper()
	var flag, exists bool
	require.NoError(t, pool.QueryRow(context.Background(), `
SELECT p.has_overrides, EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = p.name)
  FROM pgrl_policy AS p WHERE p.name = $1`, name).Scan(&flag, &exists))
	require.Equal(t, exists, flag, "has_overrides of %s agrees with the override table", name)
	return flag
}

// pgrl_policy.has_overrides follows every way overrides are written: insert,
// update (moved to another policy too), delete, truncate, a policy's
// deletion, and a hand-written value, which is replaced by the truth. Its
// upkeep changes neither the policy's updated_at nor sends a notification
// of the policy's own, and a write that leaves the flag as it is leaves the
// policy's row as it is.
func TestHasOverridesFollowsTheOverrideTable(t *testing.T) {
	t.Parallel()
	pool, schema := dbtest.Pool(t)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err, sql)
	}
	exec(`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a', 5, '1 minute'), ('b', 5, '1 minute')`)
	require.False(t, hasOverrides(t, pool, "a"))

	var before time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT updated_at FROM pgrl_policy WHERE name = 'a'`).Scan(&before))
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `LISTEN pgrl_policy`)
	require.NoError(t, err)

	exec(`INSERT INTO pgrl_policy_override (policy, key, "limit")
	      SELECT 'a', pgrl_policy_key('a', 'k' || i), 1 FROM generate_series(1, 3) AS i`)
	require.True(t, hasOverrides(t, pool, "a"))
	require.False(t, hasOverrides(t, pool, "b"))
	var after time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT updated_at FROM pgrl_policy WHERE name = 'a'`).Scan(&after))
	require.Equal(t, before, after, "an override leaves the policy's updated_at alone")
	// The three overrides' notifications, and none of the policy's row.
	var got []string
	for {
		wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		n, err := conn.Conn().WaitForNotification(wctx)
		cancel()
		if err != nil {
			break
		}
		if strings.Contains(n.Payload, `"schema":"`+schema+`"`) {
			got = append(got, n.Payload)
		}
	}
	require.Len(t, got, 3, "%q", got)
	for _, p := range got {
		require.Contains(t, p, `"table":"pgrl_policy_override"`, "only the overrides' own notifications")
	}

	// overrides_revision (migration 000021) changes with the set of keys
	// and only then: a write of an override's figures leaves the policy's
	// row as it is (a check reads that row, and would walk a dead version
	// per override written).
	version := func() (xmin string, revision int64) {
		t.Helper()
		require.NoError(t, pool.QueryRow(ctx, `SELECT xmin::text, overrides_revision FROM pgrl_policy WHERE name = 'a'`).Scan(&xmin, &revision))
		return xmin, revision
	}
	seen := map[int64]bool{}
	fresh := func(what string) {
		t.Helper()
		_, r := version()
		require.False(t, seen[r], "%s: revision %d is new", what, r)
		seen[r] = true
	}
	fresh("before")
	exec(`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('a', pgrl_policy_key('a', 'k4'), 1)`)
	fresh("a key added")
	v, r := version()
	exec(`UPDATE pgrl_policy_override SET "limit" = 2 WHERE policy = 'a'`)
	exec(`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('a', pgrl_policy_key('a', 'k4'), 3)
	      ON CONFLICT (policy, key) DO UPDATE SET "limit" = excluded."limit"`)
	v2, r2 := version()
	require.Equal(t, v, v2, "no new version of the policy's row for figures")
	require.Equal(t, r, r2, "nor a new revision")
	exec(`UPDATE pgrl_policy_override SET key = pgrl_policy_key('a', 'k5') WHERE policy = 'a' AND key = pgrl_policy_key('a', 'k4')`)
	fresh("a key changed")
	exec(`DELETE FROM pgrl_policy_override WHERE policy = 'a' AND key = pgrl_policy_key('a', 'k5')`)
	fresh("a key removed")
	require.True(t, hasOverrides(t, pool, "a"))
	exec(`UPDATE pgrl_policy SET overrides_revision = 1 WHERE name = 'a'`)
	fresh("a hand-written revision is replaced")
	exec(`UPDATE pgrl_policy SET "limit" = 5 WHERE name = 'a'`)
	_, r3 := version()
	require.True(t, seen[r3], "a policy's own change leaves its revision")

	// Moved to policy b: both follow.
	exec(`UPDATE pgrl_policy_override SET policy = 'b', key = pgrl_policy_key('b', 'moved')
	       WHERE policy = 'a' AND key = pgrl_policy_key('a', 'k1')`)
	require.True(t, hasOverrides(t, pool, "a"))
	require.True(t, hasOverrides(t, pool, "b"))
	exec(`DELETE FROM pgrl_policy_override WHERE policy = 'a' AND key = pgrl_policy_key('a', 'k2')`)
	require.True(t, hasOverrides(t, pool, "a"), "one left")
	exec(`DELETE FROM pgrl_policy_override WHERE policy = 'a'`)
	require.False(t, hasOverrides(t, pool, "a"))
	require.True(t, hasOverrides(t, pool, "b"))

	// A hand-written value is replaced by the truth.
	exec(`UPDATE pgrl_policy SET has_overrides = NOT has_overrides`)
	require.False(t, hasOverrides(t, pool, "a"))
	require.True(t, hasOverrides(t, pool, "b"))

	exec(`TRUNCATE pgrl_policy_override`)
	require.False(t, hasOverrides(t, pool, "b"))

	// A policy deleted with its overrides, then created again, has none,
	// and a revision never seen, whatever its INSERT asked for.
	exec(`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('b', pgrl_policy_key('b', 'x'), 1)`)
	var old int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT overrides_revision FROM pgrl_policy WHERE name = 'b'`).Scan(&old))
	exec(`DELETE FROM pgrl_policy WHERE name = 'b'`)
	exec(`INSERT INTO pgrl_policy (name, "limit", "window", overrides_revision) VALUES ('b', 5, '1 minute', $1)`, old)
	require.False(t, hasOverrides(t, pool, "b"))
	var again int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT overrides_revision FROM pgrl_policy WHERE name = 'b'`).Scan(&again))
	require.Greater(t, again, old, "a new revision")

	// A policy's own change still touches it and notifies.
	exec(`UPDATE pgrl_policy SET "limit" = 6 WHERE name = 'a'`)
	require.NoError(t, pool.QueryRow(ctx, `SELECT updated_at FROM pgrl_policy WHERE name = 'a'`).Scan(&after))
	require.True(t, after.After(before), "the policy's own change touches it")
}

// Two transactions that write overrides of one policy at once leave
// has_overrides true exactly when an override is left, in either order of
// locking: the last one to commit counts the other's rows too.
func TestHasOverridesUnderConcurrentWriters(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('c', 5, '1 minute')`)
	require.NoError(t, err)
	insertX := `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('c', pgrl_policy_key('c', 'x'), 1)`
	deleteX := `DELETE FROM pgrl_policy_override WHERE policy = 'c' AND key = pgrl_policy_key('c', 'x')`
	insertY := `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('c', pgrl_policy_key('c', 'y'), 1)`
	deleteY := `DELETE FROM pgrl_policy_override WHERE policy = 'c' AND key = pgrl_policy_key('c', 'y')`

	// run has first write (and lock the policy's row) in one transaction,
	// then second in another, which waits for the row; first commits,
	// then second.
	run := func(first, second string) {
		t.Helper()
		t1, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = t1.Rollback(ctx) }()
		t2, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = t2.Rollback(ctx) }()
		_, err = t1.Exec(ctx, first)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() {
			_, err := t2.Exec(ctx, second)
			done <- err
		}()
		waitForLockWait(t, pool, t2.Conn().PgConn().PID())
		require.NoError(t, t1.Commit(ctx))
		require.NoError(t, <-done)
		require.NoError(t, t2.Commit(ctx))
	}

	_, err = pool.Exec(ctx, insertX)
	require.NoError(t, err)
	run(deleteX, insertY) // the deleter locks first, sees no override left
	require.True(t, hasOverrides(t, pool, "c"), "y is left")

	_, err = pool.Exec(ctx, deleteY)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insertX)
	require.NoError(t, err)
	run(insertY, deleteX) // the inserter locks first; the deleter's snapshot began before y
	require.True(t, hasOverrides(t, pool, "c"), "y is left")

	run(deleteY, insertX) // x again
	require.True(t, hasOverrides(t, pool, "c"))
	_, err = pool.Exec(ctx, deleteX)
	require.NoError(t, err)
	require.False(t, hasOverrides(t, pool, "c"))
}

// waitForLockWait returns once the backend pid waits for a lock.
func waitForLockWait(t *testing.T, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		err := pool.QueryRow(context.Background(), `
SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, int64(pid)).Scan(&n)
		require.NoError(t, err)
		if n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the second transaction never waited for the policy's row")
}
