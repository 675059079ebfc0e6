package policy_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
)

// floodDatabase returns a pool on a migrated database of the test's own, and
// its URL: NOTIFY reaches every listener of a database, whatever its schema,
// and a flood must not reach other tests'.
func floodDatabase(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	dbURL := dbtest.NewDatabase(t)
	conn, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	require.NoError(t, dbtest.Apply(ctx, conn, ""))
	require.NoError(t, conn.Close(ctx))
	pool, err := pgxpool.New(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, dbURL
}

// Any role that can connect may NOTIFY pgrl_policy with a payload that is
// not a change, or one that looks like a TRUNCATE. A flood of them costs at most one full reload per
// MinResyncInterval (the others merged into it), never a reconnection,
// while a real change is still applied at once: a FromCache limiter obeys
// it during the flood.
func TestListenerUnreadableFloodBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, dbURL := floodDatabase(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	const interval = 200 * time.Millisecond
	// A short backoff: a listener that reconnected after each unreadable
	// payload would reload many times more often than the bound.
	l, err := policy.Watch(ctx, dbURL, cache, policy.ListenerOptions{
		MinBackoff: 2 * time.Millisecond, MaxBackoff: 10 * time.Millisecond, MinResyncInterval: interval})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache, FromCache: true})
	require.NoError(t, err)
	before := l.Stats()

	// The flood: two unreadable payloads and a forged TRUNCATE (which
	// asks for a full reload too) per statement, until told to stop.
	var sent atomic.Int64
	stop, flooded := make(chan struct{}), make(chan error, 1)
	start := time.Now()
	go func() {
		for {
			select {
			case <-stop:
				flooded <- nil
				return
			default:
			}
			if _, err := pool.Exec(ctx, `SELECT pg_notify('pgrl_policy', 'not a change'), pg_notify('pgrl_policy', '{"schema":'),
				pg_notify('pgrl_policy', '{"schema": "public", "table": "pgrl_policy", "op": "TRUNCATE", "policy": null}')`); err != nil {
				flooded <- err
				return
			}
			sent.Add(2)
			time.Sleep(2 * time.Millisecond) // about 1,000 a second: NOTIFY serialises commits server-wide
		}
	}()
	require.Eventually(t, func() bool { return l.Stats().Dropped >= before.Dropped+50 }, 10*time.Second, time.Millisecond,
		"the listener reads the flood")

	// A real change during the flood reaches the FromCache limiter.
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 20 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		d, err := lim.Allow(ctx, "k")
		return err == nil && d.Limit == 20
	}, 5*time.Second, 5*time.Millisecond, "the change is applied during the flood")
	// Flood a while longer: at least ten intervals in all.
	for time.Since(start) < 10*interval {
		time.Sleep(interval / 4)
	}
	close(stop)
	require.NoError(t, <-flooded)
	elapsed := time.Since(start)
	st := l.Stats()
	reloads := st.Resyncs - before.Resyncs
	bound := uint64(elapsed/interval) + 1
	t.Logf("%d unreadable notifications in %v: %d full reloads (bound %d), %d requests merged, %d reconnects",
		sent.Load(), elapsed.Round(time.Millisecond), reloads, bound, st.ResyncsMerged-before.ResyncsMerged,
		st.Reconnects-before.Reconnects)
	require.LessOrEqual(t, reloads, bound, "at most one full reload per MinResyncInterval")
	require.GreaterOrEqual(t, reloads, uint64(1), "the flood's requests were answered by reloads")
	require.Equal(t, before.Reconnects, st.Reconnects, "an unreadable payload does not end the session")
	require.True(t, st.Connected)
	// Every payload is counted, and the requests that waited for the
	// interval were merged into the reloads after it.
	require.Eventually(t, func() bool {
		st := l.Stats()
		return st.Dropped-before.Dropped == uint64(sent.Load()) && st.ResyncsMerged > before.ResyncsMerged &&
			st.Applied-before.Applied >= uint64(sent.Load()/2)
	}, 5*time.Second, 5*time.Millisecond, "every unreadable payload is counted, every TRUNCATE applied")
}

// A notification may also name a policy as changed, as often as its sender
// likes; the whole reload of a policy with thousands of overrides costs
// about what a full one does, so it too is bounded: at most one per
// MinResyncInterval per policy, the rest merged into a full reload at the
// same bounded rate. A real change of the policy is applied all the same.
func TestListenerPolicyFloodBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, dbURL := floodDatabase(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "big", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit")
		SELECT 'big', pgrl_policy_key('big', 't' || i), 100 + i FROM generate_series(1, 1500) i`)
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	const interval = 200 * time.Millisecond
	l, err := policy.Watch(ctx, dbURL, cache, policy.ListenerOptions{MinResyncInterval: interval})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	before := l.Stats()

	var sent atomic.Int64
	stop, flooded := make(chan struct{}), make(chan error, 1)
	start := time.Now()
	go func() {
		for {
			select {
			case <-stop:
				flooded <- nil
				return
			default:
			}
			if _, err := pool.Exec(ctx, `SELECT pg_notify('pgrl_policy',
				'{"schema": "public", "table": "pgrl_policy", "op": "UPDATE", "policy": "big"}')`); err != nil {
				flooded <- err
				return
			}
			sent.Add(1)
			time.Sleep(2 * time.Millisecond)
		}
	}()
	require.Eventually(t, func() bool { return l.Stats().Received >= before.Received+50 }, 10*time.Second, time.Millisecond,
		"the listener reads the flood")
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 20 WHERE name = 'big'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return limitOf(cache, "big") == 20 }, 5*time.Second, 5*time.Millisecond,
		"the change is applied during the flood")
	for time.Since(start) < 10*interval {
		time.Sleep(interval / 4)
	}
	close(stop)
	require.NoError(t, <-flooded)
	elapsed := time.Since(start)
	st := l.Stats()
	policyReloads, resyncs := st.PolicyReloads-before.PolicyReloads, st.Resyncs-before.Resyncs
	bound := uint64(elapsed/interval) + 1
	t.Logf("%d notifications of a policy with 1,500 overrides in %v: %d reloads of it and %d full ones (bound %d each)",
		sent.Load(), elapsed.Round(time.Millisecond), policyReloads, resyncs, bound)
	require.LessOrEqual(t, policyReloads, bound, "at most one whole reload of the policy per MinResyncInterval")
	require.LessOrEqual(t, resyncs, bound, "at most one full reload per MinResyncInterval")
	require.Equal(t, before.Reconnects, st.Reconnects)
	require.Eventually(t, func() bool {
		st := l.Stats()
		return st.Applied-before.Applied == uint64(sent.Load())+1
	}, 5*time.Second, 5*time.Millisecond, "every notification is applied, by one reload or another")
}
