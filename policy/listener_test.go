package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

func limitOf(c *policy.Cache, name string) int64 {
	p, ok := c.Policy(name)
	if !ok {
		return -1
	}
	return p.Limit
}

// A change by plain SQL reaches the cache within a second; a change in
// another schema's installation does not; a killed listener reconnects and
// reloads, catching up with what changed while it was away; Close turns it
// off.
func TestListenerFollowsChanges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	otherPool, _ := dbtest.Pool(t)
	admin := dbtest.Admin(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.Set(ctx, otherPool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)

	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	require.Equal(t, int64(10), limitOf(cache, "api"))
	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache,
		Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: time.Minute})})
	require.NoError(t, err)

	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 20 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return limitOf(cache, "api") == 20 }, 10*time.Second, 5*time.Millisecond)
	d, err := lim.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(20), d.Limit, "the limiter follows the cache")

	// Overrides are followed too.
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', pgrl_stored_key('api', 'vip'), 100)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		d, err := lim.Peek(ctx, "vip")
		return err == nil && d.Limit == 100
	}, 10*time.Second, 5*time.Millisecond)

	// Another schema's change is ignored.
	_, err = otherPool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 99 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return l.Stats().Ignored >= 1 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, int64(20), limitOf(cache, "api"))

	// Kill the listener's backend, change the policy at once: the
	// listener reconnects, reloads and sees it.
	pid := l.PID()
	require.NotZero(t, pid)
	var killed bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, int32(pid)).Scan(&killed))
	require.True(t, killed)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 30 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st := l.Stats()
		return st.Reconnects >= 1 && st.Resyncs >= 2 && st.Connected && limitOf(cache, "api") == 30
	}, 5*time.Second, 10*time.Millisecond)
	require.NotEqual(t, pid, l.PID())
	d, err = lim.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(30), d.Limit)

	// TRUNCATE reloads everything; DELETE removes the policy.
	_, err = pool.Exec(ctx, `DELETE FROM pgrl_policy WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return limitOf(cache, "api") == -1 }, 10*time.Second, 5*time.Millisecond)
	_, err = lim.Allow(ctx, "k")
	require.ErrorIs(t, err, policy.ErrNotFound)

	// Turned off: changes no longer arrive.
	require.NoError(t, l.Close())
	require.False(t, l.Stats().Connected)
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "late", Limit: 1, Window: time.Minute})
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)
	require.Equal(t, int64(-1), limitOf(cache, "late"))
}

// A change that sends no NOTIFY (triggers off, as in a bulk load) is picked
// up by the periodic resync, and the connection survives the timer.
func TestListenerResyncInterval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{ResyncInterval: 100 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	pid := l.PID()

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SET LOCAL session_replication_role = replica`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 11 WHERE name = 'api'`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Eventually(t, func() bool { return limitOf(cache, "api") == 11 }, 2*time.Second, 10*time.Millisecond)
	require.Zero(t, l.Stats().Received, "no notification was sent")

	// Notifications still arrive on the same connection.
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 12 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return limitOf(cache, "api") == 12 }, 10*time.Second, 5*time.Millisecond)
	st := l.Stats()
	require.Equal(t, pid, l.PID())
	require.Zero(t, st.Reconnects)
	require.GreaterOrEqual(t, st.Resyncs, uint64(2))
}

// Notifications that name overrides reload those rows; a burst of them (one
// statement changing thousands) reloads the policy once; both leave the
// cache equal to the tables.
func TestListenerOverrideNotifications(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "other", Limit: 1, Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	// Its checks wait as long as PostgreSQL needs: under load the default
	// 500 ms Timeout ended a Peek before it was answered.
	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache,
		Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: time.Minute})})
	require.NoError(t, err)
	limitFor := func(key string) int64 {
		d, err := lim.Peek(ctx, key)
		require.NoError(t, err)
		return d.Limit
	}

	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit")
		SELECT 'api', pgrl_stored_key('api', 't' || i), 100 + i FROM generate_series(1, 3000) i`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return limitFor("t3000") == 3100 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(101), limitFor("t1"))

	_, err = pool.Exec(ctx, `UPDATE pgrl_policy_override SET "limit" = 7 WHERE key = pgrl_stored_key('api', 't1')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM pgrl_policy_override WHERE key = pgrl_stored_key('api', 't2')`)
	require.NoError(t, err)
	// Moving an override to another key sends both keys.
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy_override SET key = pgrl_stored_key('api', 'moved') WHERE key = pgrl_stored_key('api', 't3')`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return limitFor("t1") == 7 && limitFor("t2") == 10 && limitFor("t3") == 10 && limitFor("moved") == 103
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, int64(104), limitFor("t4"), "the other overrides stay")
	require.Equal(t, int64(1), limitOf(cache, "other"))

	// ReloadOverrides directly: an expired override leaves the cache.
	// (SetOverride refuses a past expiry; an UPDATE can expire a row.)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit", expires_at)
		VALUES ('api', pgrl_policy_key('api', 't5'), 5, now() - interval '1 second')
		ON CONFLICT (policy, key) DO UPDATE SET "limit" = excluded."limit", expires_at = excluded.expires_at`)
	require.NoError(t, err)
	require.NoError(t, cache.ReloadOverrides(ctx, "api", [][]byte{p.StoredKey("t5")}))
	require.Equal(t, int64(10), limitFor("t5"))
	st := l.Stats()
	require.Zero(t, st.Dropped)
	require.Zero(t, st.Reconnects)
	require.GreaterOrEqual(t, st.Received, uint64(3004))
}
