package policy_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

var (
	_ httplimit.Checker      = (*policy.Limiter)(nil)
	_ httplimit.KeyedLimiter = (*policy.Limiter)(nil)
)

// tenantHandler serves 204 behind mw, keyed by the X-Tenant header, and
// returns a function that sends one request for a tenant.
func tenantHandler(t *testing.T, cfg httplimit.Config) func(tenant string) *httptest.ResponseRecorder {
	t.Helper()
	if cfg.Key == nil {
		cfg.Key = httplimit.ByHeader("X-Tenant")
	}
	mw, err := httplimit.New(cfg)
	require.NoError(t, err)
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	return func(tenant string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Tenant", tenant)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
}

// A policy's limiter serves as the HTTP middleware's limit, overrides
// included, and RateLimit-Policy reports the rate applied to each request:
// the override's for a key that has one, the policy as last loaded for the
// others.
func TestHTTPMiddleware(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 1, Window: time.Hour})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("vip"), Limit: 2})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("daily"), Limit: 10, Window: 24 * time.Hour})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache})
	require.NoError(t, err)
	require.Equal(t, int64(1), lim.Config().Limit)
	get := tenantHandler(t, httplimit.Config{Limiter: lim})
	check := func(tenant string, status int, policyField, rateField string) {
		t.Helper()
		w := get(tenant)
		require.Equal(t, status, w.Code, tenant)
		require.Equal(t, policyField, w.Header().Get("RateLimit-Policy"), tenant)
		require.Regexp(t, rateField, w.Header().Get("RateLimit"), tenant)
	}
	check("plain", http.StatusNoContent, `"api";q=1;w=3600`, `^"api";r=0;t=\d+$`)
	check("plain", http.StatusTooManyRequests, `"api";q=1;w=3600`, `^"api";r=0;t=\d+$`)
	check("vip", http.StatusNoContent, `"api";q=2;w=3600`, `^"api";r=1;t=\d+$`)
	check("vip", http.StatusNoContent, `"api";q=2;w=3600`, `^"api";r=0;t=\d+$`)
	check("vip", http.StatusTooManyRequests, `"api";q=2;w=3600`, `^"api";r=0;t=\d+$`)
	check("daily", http.StatusNoContent, `"api";q=10;w=86400`, `^"api";r=9;t=\d+$`)

	// A change of the policy shows in the next response's fields, for the
	// keys it governs; the override's key keeps its own limit.
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 3 WHERE name = 'api'`)
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "api"))
	check("plain", http.StatusNoContent, `"api";q=3;w=3600`, `^"api";r=1;t=\d+$`)
	check("vip", http.StatusTooManyRequests, `"api";q=2;w=3600`, `^"api";r=0;t=\d+$`)
}

// In a multi-limit middleware a policy's limiter is a Rule's Keyed limit:
// decided with the others in one round trip, at the rate of the key's
// override, and reported as such.
func TestHTTPMiddlewareRules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "per-tenant", Limit: 1, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "per-tenant", Key: p.StoredKey("vip"), Limit: 3})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	perTenant, err := newLimiter(ctx, pool, "per-tenant", policy.Options{Cache: cache})
	require.NoError(t, err)
	ceiling, err := testkit.New(pool, ratelimit.Config{Name: "ceiling", Limit: 100, Window: time.Hour})
	require.NoError(t, err)
	get := tenantHandler(t, httplimit.Config{Logger: slog.New(slog.DiscardHandler), Rules: []httplimit.Rule{
		{Keyed: perTenant},
		{Limiter: ceiling, Key: httplimit.Constant("all")},
	}})
	for i, want := range []int{http.StatusNoContent, http.StatusNoContent, http.StatusNoContent, http.StatusTooManyRequests} {
		w := get("vip")
		require.Equal(t, want, w.Code, "vip request %d", i+1)
		require.Equal(t, `"per-tenant";q=3;w=60, "ceiling";q=100;w=3600`, w.Header().Get("RateLimit-Policy"))
	}
	require.Equal(t, http.StatusNoContent, get("plain").Code)
	w := get("plain")
	require.Equal(t, http.StatusTooManyRequests, w.Code)
	require.Equal(t, `"per-tenant";q=1;w=60, "ceiling";q=100;w=3600`, w.Header().Get("RateLimit-Policy"))

	// A policy deleted under a running middleware is a check error (503),
	// not an unlimited request.
	require.NoError(t, policy.Delete(ctx, pool, "per-tenant"))
	require.NoError(t, cache.ReloadPolicy(ctx, "per-tenant"))
	require.Equal(t, http.StatusServiceUnavailable, get("vip").Code)
}
