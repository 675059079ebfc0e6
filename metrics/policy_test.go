package metrics_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/metrics"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// The policy collector's series are scraped with the listener's counters
// and the cache's size, and each is named in docs/METRICS.md.
func TestPolicyCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{Denials: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))

	reg := prometheus.NewRegistry()
	_, err = metrics.NewPolicyCollector(reg, l, cache)
	require.NoError(t, err)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("k"), Limit: 9})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return l.Stats().Applied == 1 }, 10*time.Second, 5*time.Millisecond)
	// A readable mark of this schema for a limiter nobody registered (an
	// unreadable one would be counted by every listening test).
	until := time.Now().Add(time.Hour).UnixMicro()
	mark := fmt.Sprintf(`{"v":1,"schema":%q,"limiter":"nobody","alg":"fixed_window","window_us":60000000,"limit":5,"burst":5,`+
		`"marks":[{"key":"%x","cost":1,"until_us":%d,"reset_us":%d,"used":5}]}`, s, p.StoredKey("k"), until, until)
	_, err = pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ratelimit.DenyChannel, mark)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return l.Stats().Denials.Unknown == 1 }, 5*time.Second, 5*time.Millisecond)
	samples, types := scrape(t, srv.URL)
	require.Equal(t, "1", samples[`pgrl_policy_shared_denials_total{outcome="unknown"}`])
	require.Equal(t, "0", samples[`pgrl_policy_shared_denials_total{outcome="dropped"}`])
	require.Equal(t, "1", samples[`pgrl_policy_notifications_total{outcome="applied"}`])
	require.Equal(t, "0", samples[`pgrl_policy_notifications_total{outcome="dropped"}`])
	require.Equal(t, "1", samples[metrics.PolicyListenerConnected])
	require.Equal(t, "1", samples[metrics.PolicyResyncsTotal])
	require.Equal(t, "0", samples[metrics.PolicyReconnectsTotal])
	require.Equal(t, "1", samples[metrics.PolicyCachePolicies])
	require.Equal(t, "1", samples[metrics.PolicyCacheOverrides])
	require.NotEqual(t, "0", samples[metrics.PolicyCacheLoaded])
	require.Equal(t, "counter", types[metrics.PolicyNotificationsTotal])
	require.Equal(t, "gauge", types[metrics.PolicyListenerConnected])

	doc, err := os.ReadFile("../docs/METRICS.md")
	require.NoError(t, err)
	for _, name := range []string{metrics.PolicyNotificationsTotal, metrics.PolicyReconnectsTotal, metrics.PolicyResyncsTotal,
		metrics.PolicyListenerConnected, metrics.PolicyCachePolicies, metrics.PolicyCacheOverrides, metrics.PolicyCacheLoaded,
		metrics.PolicyDenialsTotal} {
		require.Contains(t, string(doc), "`"+name, "docs/METRICS.md does not name %s", name)
	}
}
