package policy_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
)

var _ httplimit.Checker = (*policy.Limiter)(nil)

// A policy's limiter serves as the HTTP middleware's limit, overrides
// included.
func TestHTTPMiddleware(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 1, Window: time.Hour})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("vip"), Limit: 2})
	require.NoError(t, err)
	lim, err := policy.NewLimiter(ctx, pool, "api", policy.Options{})
	require.NoError(t, err)
	require.Equal(t, int64(1), lim.Config().Limit)
	mw, err := httplimit.New(httplimit.Config{
		Limiter: lim,
		Key:     func(r *http.Request) (string, bool) { return r.Header.Get("X-Tenant"), true },
	})
	require.NoError(t, err)
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	status := func(tenant string) int {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Tenant", tenant)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code
	}
	require.Equal(t, http.StatusNoContent, status("plain"))
	require.Equal(t, http.StatusTooManyRequests, status("plain"))
	require.Equal(t, http.StatusNoContent, status("vip"))
	require.Equal(t, http.StatusNoContent, status("vip"))
	require.Equal(t, http.StatusTooManyRequests, status("vip"))
}
