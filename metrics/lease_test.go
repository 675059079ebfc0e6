package metrics_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/metrics"
	"github.com/pgrl/pgrl/ratelimit"
)

// leaseSamples is what a scrape must show for the lease limiter name with
// the counters st, each series mapped by hand from its Stats field.
func leaseSamples(name string, st lease.Stats) map[string]string {
	v := func(n int64) string { return fmt.Sprint(n) }
	l := fmt.Sprintf("limiter=%q", name)
	return map[string]string{
		`pgrl_lease_slices_total{` + l + `}`:                     v(st.Slices),
		`pgrl_lease_units_leased_total{` + l + `}`:               v(st.Leased),
		`pgrl_lease_units_total{` + l + `,outcome="used"}`:       v(st.UsedLocally),
		`pgrl_lease_units_total{` + l + `,outcome="returned"}`:   v(st.Returned),
		`pgrl_lease_units_total{` + l + `,outcome="dropped"}`:    v(st.Dropped),
		`pgrl_lease_decisions_total{` + l + `,store="lease"}`:    v(st.LocalDecisions),
		`pgrl_lease_decisions_total{` + l + `,store="postgres"}`: v(st.DatabaseDecisions),
		`pgrl_lease_decisions_total{` + l + `,store="other"}`:    v(st.OtherDecisions),
	}
}

// leaseSeries is the scraped samples of the pgrl_lease_ series.
func leaseSeries(samples map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range samples {
		if strings.HasPrefix(k, "pgrl_lease_") {
			out[k] = v
		}
	}
	return out
}

// A lease limiter's checks, from its slices, from PostgreSQL and from its
// deny cache, then a Reset and a Close: every counter of Stats is scraped
// with its value under its own series, each value different from the
// others so that a field mapped to the wrong series fails.
func TestLeaseCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	now := func() time.Time { return base }
	// Timeout: on a busy machine the default would let the memory tier
	// answer a slice's ask.
	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "api", Limit: 100, Window: time.Minute},
		ratelimit.DatabaseOptions{Timeout: time.Minute, Now: now})
	x, err := lease.New(lim, lease.Options{Eager: true, Size: 10, DB: pool, Idle: time.Hour, Now: now})
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close(ctx) })

	reg := prometheus.NewRegistry()
	lc, err := metrics.NewLeaseCollector(reg, x)
	require.NoError(t, err)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	// Before any check: every series, at 0.
	samples, types := scrape(t, srv.URL)
	require.Equal(t, leaseSamples("api", lease.Stats{}), leaseSeries(samples))
	for _, name := range []string{metrics.LeaseSlicesTotal, metrics.LeaseUnitsLeasedTotal, metrics.LeaseUnitsTotal, metrics.LeaseDecisionsTotal} {
		require.Equal(t, "counter", types[name], "TYPE of %s", name)
	}

	allow := func(key string, want ratelimit.Store, allowed bool) {
		t.Helper()
		d, err := x.Allow(ctx, key)
		require.NoError(t, err)
		require.Equal(t, want, d.Store, key)
		require.Equal(t, allowed, d.Allowed, key)
	}
	// a: a slice of 10, 9 checks from it, a second slice, 3 from it (6 left).
	allow("a", ratelimit.StorePostgres, true)
	for range 9 {
		allow("a", ratelimit.StoreLease, true)
	}
	allow("a", ratelimit.StorePostgres, true)
	for range 3 {
		allow("a", ratelimit.StoreLease, true)
	}
	// b: a slice of 10, 1 check from it, then a Reset drops the 8 left.
	allow("b", ratelimit.StorePostgres, true)
	allow("b", ratelimit.StoreLease, true)
	require.NoError(t, x.Reset(ctx, "b"))
	// c: used up by the limiter itself; the lease's ask is denied by
	// PostgreSQL (no slice), the next ones by the deny cache.
	_, err = lim.Allow(ctx, "c", ratelimit.Cost(100))
	require.NoError(t, err)
	allow("c", ratelimit.StorePostgres, false)
	allow("c", ratelimit.StoreDenyCache, false)
	allow("c", ratelimit.StoreDenyCache, false)
	// Close returns a's 6 units.
	require.NoError(t, x.Close(ctx))

	st := x.Stats()
	require.Equal(t, lease.Stats{
		Slices: 3, Leased: 30, UsedLocally: 16, Returned: 6, Dropped: 8,
		LocalDecisions: 13, DatabaseDecisions: 4, OtherDecisions: 2,
	}, st)
	samples, _ = scrape(t, srv.URL)
	require.Equal(t, leaseSamples("api", st), leaseSeries(samples))

	// A second limiter of another name gets series of its own; one of a
	// name already collected, and nil, are refused.
	other := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "other", Limit: 50, Window: time.Minute},
		ratelimit.DatabaseOptions{Timeout: time.Minute, Now: now})
	y, err := lease.New(other, lease.Options{Eager: true, Size: 5, Now: now})
	require.NoError(t, err)
	t.Cleanup(func() { _ = y.Close(ctx) })
	require.NoError(t, lc.Add(y))
	d, err := y.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)

	again, err := lease.New(lim, lease.Options{Size: 5})
	require.NoError(t, err)
	t.Cleanup(func() { _ = again.Close(ctx) })
	err = lc.Add(again)
	require.ErrorIs(t, err, metrics.ErrDuplicateLease)
	require.Contains(t, err.Error(), `"api"`)
	require.ErrorIs(t, lc.Add(x), metrics.ErrDuplicateLease)
	require.ErrorIs(t, lc.Add(nil), metrics.ErrNilLease)

	samples, _ = scrape(t, srv.URL)
	want := leaseSamples("api", st)
	for k, v := range leaseSamples("other", lease.Stats{Slices: 1, Leased: 5, UsedLocally: 1, DatabaseDecisions: 1}) {
		want[k] = v
	}
	require.Equal(t, want, leaseSeries(samples))

	// Removed, a name can be collected again: the successor's counters.
	require.False(t, lc.Remove(again))
	require.True(t, lc.Remove(x))
	require.False(t, lc.Remove(x))
	require.NoError(t, lc.Add(again))
	samples, _ = scrape(t, srv.URL)
	want = leaseSamples("api", lease.Stats{})
	for k, v := range leaseSamples("other", y.Stats()) {
		want[k] = v
	}
	require.Equal(t, want, leaseSeries(samples))

	doc, err := os.ReadFile("../docs/METRICS.md")
	require.NoError(t, err)
	for _, name := range []string{metrics.LeaseSlicesTotal, metrics.LeaseUnitsLeasedTotal, metrics.LeaseUnitsTotal, metrics.LeaseDecisionsTotal} {
		require.Contains(t, string(doc), "`"+name, "docs/METRICS.md does not name %s", name)
	}
}

func TestNewLeaseCollectorRefusesNilAndDuplicates(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "api", Limit: 10, Window: time.Minute})
	x, err := lease.New(lim, lease.Options{Size: 2})
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close(context.Background()) })
	y, err := lease.New(lim, lease.Options{Size: 3})
	require.NoError(t, err)
	t.Cleanup(func() { _ = y.Close(context.Background()) })

	reg := prometheus.NewRegistry()
	_, err = metrics.NewLeaseCollector(reg, x, nil)
	require.ErrorIs(t, err, metrics.ErrNilLease)
	_, err = metrics.NewLeaseCollector(reg, x, y)
	require.ErrorIs(t, err, metrics.ErrDuplicateLease)
	// Nothing was registered by the failed calls.
	_, err = metrics.NewLeaseCollector(reg, x)
	require.NoError(t, err)
	// A second collector on the registry is refused, as a second Collector is.
	_, err = metrics.NewLeaseCollector(reg)
	var already prometheus.AlreadyRegisteredError
	require.ErrorAs(t, err, &already)
}
