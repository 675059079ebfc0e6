package tests

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
)

// A listening connection that goes silent (a network path that drops
// everything, as a failover that moved the address can) is noticed by the
// ping within PingInterval + PingTimeout, while checks go on: those that
// read the policy in their statement (the default) obey a change made
// meanwhile at once, those that use the cache (FromCache) the policy last
// loaded; once the path is back the listener reconnects and catches up.
func TestPolicyListenerNoticesASilentConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)

	u, err := url.Parse(dbtest.URLWithSchema(s))
	require.NoError(t, err)
	proxy := newProxy(t, u.Host)
	u.Host = net.JoinHostPort("127.0.0.1", fmt.Sprint(proxy.port()))

	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, u.String(), cache, policy.ListenerOptions{
		PingInterval: 200 * time.Millisecond, PingTimeout: 300 * time.Millisecond,
		MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	lim, err := policy.NewLimiter(ctx, pool, "api", policy.Options{Cache: cache, FromCache: true})
	require.NoError(t, err)
	inStatement, err := policy.NewLimiter(ctx, pool, "api", policy.Options{Cache: cache})
	require.NoError(t, err)

	proxy.stall.Store(true)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 20 WHERE name = 'api'`)
	require.NoError(t, err)
	start := time.Now()
	require.Eventually(t, func() bool { return !l.Stats().Connected }, 5*time.Second, 10*time.Millisecond)
	t.Logf("silence noticed after %v", time.Since(start).Round(time.Millisecond))
	require.Contains(t, l.Stats().LastError, "did not answer")
	d, err := lim.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(10), d.Limit, "checks go on with the policy last loaded")
	d, err = inStatement.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(20), d.Limit, "a check reading the policy obeys the change, listener or not")

	proxy.cut()
	proxy.stall.Store(false)
	require.Eventually(t, func() bool {
		st := l.Stats()
		p, ok := cache.Policy("api")
		return st.Connected && st.Reconnects >= 1 && ok && p.Limit == 20
	}, 10*time.Second, 10*time.Millisecond)
	d, err = lim.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(20), d.Limit)
}
