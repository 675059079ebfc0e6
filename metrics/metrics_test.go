package metrics_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/metrics"
	"github.com/pgrl/pgrl/ratelimit"
)

var base = time.Date(2031, 3, 4, 5, 6, 10, 0, time.UTC)

// scrape fetches the metrics endpoint over HTTP and returns each sample
// ("name{labels}" → value) and each family's TYPE.
func scrape(t *testing.T, url string) (samples map[string]string, types map[string]string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Content-Type"), "text/plain")
	samples, types = map[string]string{}, map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			types[f[2]] = f[3]
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		require.Positive(t, i, line)
		samples[line[:i]] = line[i+1:]
	}
	require.NoError(t, sc.Err())
	return samples, types
}

// documentedSeries reads the series names from docs/METRICS.md's table.
func documentedSeries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../docs/METRICS.md")
	require.NoError(t, err)
	var names []string
	for _, m := range regexp.MustCompile("(?m)^\\| `(pgrl_[a-z_]+)`").FindAllStringSubmatch(string(b), -1) {
		names = append(names, m[1])
	}
	require.NotEmpty(t, names, "no series table in docs/METRICS.md")
	return names
}

func TestScrapeFindsEveryDocumentedSeries(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	dead := testkit.DeadPool(t)
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)

	reg := prometheus.NewRegistry()
	col, err := metrics.New(reg)
	require.NoError(t, err)
	col.Init("api", "idle")
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	// Before any check: the initialised per-limiter series are there, at 0.
	samples, _ := scrape(t, srv.URL)
	require.Equal(t, "0", samples[`pgrl_breaker_open{limiter="idle"}`])
	require.Equal(t, "0", samples[`pgrl_deny_cache_hits_total{limiter="idle"}`])

	now := func() time.Time { return base }
	// Each limiter has a Database of its own: broken's breaker is its own.
	lim := func(db ratelimit.DB, cfg ratelimit.Config, opts ratelimit.DatabaseOptions) *ratelimit.Limiter {
		cfg.Window = time.Minute
		opts.Observer, opts.Logger = col, quiet
		l, err := testkit.New(db, cfg, opts)
		require.NoError(t, err)
		return l
	}
	// The limiters on the live pool wait as long as PostgreSQL needs: on a
	// busy machine the default Timeout would let the memory tier answer.
	api := lim(pool, ratelimit.Config{Name: "api", Limit: 2}, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: now})
	shadow := lim(pool, ratelimit.Config{Name: "shadow", Limit: 1, Shadow: true, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: now})
	broken := lim(dead, ratelimit.Config{Name: "broken", Limit: 5, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{BreakerThreshold: 1, BreakerCooldown: time.Hour})
	fallback := lim(dead, ratelimit.Config{Name: "fallback", Limit: 5}, ratelimit.DatabaseOptions{})
	open := lim(dead, ratelimit.Config{Name: "open", Limit: 5, OnFailure: ratelimit.FailOpen}, ratelimit.DatabaseOptions{})

	// api: 2 allowed, 1 denied by PostgreSQL, then 2 denied by the deny cache.
	for i, want := range []ratelimit.Store{ratelimit.StorePostgres, ratelimit.StorePostgres, ratelimit.StorePostgres, ratelimit.StoreDenyCache, ratelimit.StoreDenyCache} {
		d, err := api.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, want, d.Store, "check %d", i)
		require.Equal(t, i < 2, d.Allowed, "check %d", i)
	}
	for range 2 {
		_, err := shadow.Allow(ctx, "k")
		require.NoError(t, err)
	}
	for range 2 {
		_, err := broken.Allow(ctx, "k")
		require.Error(t, err)
	}
	require.True(t, broken.BreakerOpen())
	d, err := fallback.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreMemory, d.Store)
	d, err = open.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePolicy, d.Store)

	samples, types := scrape(t, srv.URL)
	want := map[string]string{
		`pgrl_decisions_total{limiter="api",outcome="allowed",store="postgres"}`:          "2",
		`pgrl_decisions_total{limiter="api",outcome="denied",store="postgres"}`:           "1",
		`pgrl_decisions_total{limiter="api",outcome="denied",store="deny_cache"}`:         "2",
		`pgrl_decisions_total{limiter="shadow",outcome="allowed",store="postgres"}`:       "1",
		`pgrl_decisions_total{limiter="shadow",outcome="shadow_denied",store="postgres"}`: "1",
		`pgrl_decisions_total{limiter="broken",outcome="error",store="none"}`:             "2",
		`pgrl_decisions_total{limiter="fallback",outcome="allowed",store="memory"}`:       "1",
		`pgrl_decisions_total{limiter="open",outcome="allowed",store="policy"}`:           "1",
		`pgrl_check_duration_seconds_count{limiter="api",store="postgres"}`:               "3",
		`pgrl_check_duration_seconds_count{limiter="api",store="deny_cache"}`:             "2",
		`pgrl_check_duration_seconds_count{limiter="broken",store="none"}`:                "2",
		`pgrl_check_duration_seconds_bucket{limiter="api",store="postgres",le="+Inf"}`:    "3",
		`pgrl_breaker_open{limiter="broken"}`:                                             "1",
		`pgrl_breaker_open{limiter="api"}`:                                                "0",
		`pgrl_deny_cache_hits_total{limiter="api"}`:                                       "2",
		`pgrl_deny_cache_hits_total{limiter="idle"}`:                                      "0",
	}
	for k, v := range want {
		require.Equal(t, v, samples[k], k)
	}
	// Exactly these decision series exist: no outcome or store is counted
	// twice or under another name.
	var got []string
	for k := range samples {
		if strings.HasPrefix(k, "pgrl_decisions_total{") {
			got = append(got, k)
		}
	}
	sort.Strings(got)
	var wantDecisions []string
	for k := range want {
		if strings.HasPrefix(k, "pgrl_decisions_total{") {
			wantDecisions = append(wantDecisions, k)
		}
	}
	sort.Strings(wantDecisions)
	require.Equal(t, wantDecisions, got)

	// Every documented series is served with its documented type, and
	// every pgrl series served is documented.
	docTypes := map[string]string{
		metrics.DecisionsTotal: "counter", metrics.CheckDuration: "histogram",
		metrics.BreakerOpen: "gauge", metrics.DenyCacheHitsTotal: "counter",
	}
	documented := documentedSeries(t)
	require.ElementsMatch(t, []string{metrics.DecisionsTotal, metrics.CheckDuration, metrics.BreakerOpen, metrics.DenyCacheHitsTotal}, documented)
	for _, name := range documented {
		require.Equal(t, docTypes[name], types[name], "TYPE of %s", name)
	}
	for name := range types {
		if strings.HasPrefix(name, "pgrl_") {
			require.Contains(t, documented, name)
		}
	}

	// The breaker closes when the database answers again; here, a limiter
	// whose breaker was opened by hand through the Observer interface.
	col.ObserveBreaker("broken", false)
	samples, _ = scrape(t, srv.URL)
	require.Equal(t, "0", samples[`pgrl_breaker_open{limiter="broken"}`])
}

func TestNewTwiceOnOneRegistryFails(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	_, err := metrics.New(reg)
	require.NoError(t, err)
	_, err = metrics.New(reg)
	var already prometheus.AlreadyRegisteredError
	require.ErrorAs(t, err, &already)
}

func TestObserveDecisionOutcomes(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	col, err := metrics.New(reg)
	require.NoError(t, err)
	col.ObserveDecision("x", ratelimit.Decision{Allowed: true, Granted: 1, Store: ratelimit.StoreMemory}, 3*time.Millisecond, nil)
	col.ObserveDecision("x", ratelimit.Decision{Allowed: false, Store: ratelimit.StorePolicy}, time.Millisecond, nil)
	col.ObserveDecision("x", ratelimit.Decision{}, time.Millisecond, io.ErrUnexpectedEOF)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	samples, _ := scrape(t, srv.URL)
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="x",outcome="allowed",store="memory"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="x",outcome="denied",store="policy"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="x",outcome="error",store="none"}`])
	require.Equal(t, "0.003", samples[`pgrl_check_duration_seconds_sum{limiter="x",store="memory"}`])
	// 3 ms falls in the 5 ms bucket, not the 2.5 ms one.
	require.Equal(t, "0", samples[`pgrl_check_duration_seconds_bucket{limiter="x",store="memory",le="0.0025"}`])
	require.Equal(t, "1", samples[`pgrl_check_duration_seconds_bucket{limiter="x",store="memory",le="0.005"}`])
}

// TestRefusedGroupNotCountedAsAllowed decides two limits together under
// AllOrNothing, one of which denies: once from PostgreSQL, once from the
// deny cache. The other limit's check took nothing and the request was
// refused, so it is counted as not_counted, never as allowed.
func TestRefusedGroupNotCountedAsAllowed(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	reg := prometheus.NewRegistry()
	col, err := metrics.New(reg)
	require.NoError(t, err)
	at := func() time.Time { return base }
	// One Database: the limits of one AllowAll.
	db := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Observer: col, Timeout: time.Minute, Now: at})
	strict := testkit.Limiter(t, db, ratelimit.Config{Name: "strict", Limit: 1, Window: time.Hour})
	loose := testkit.Limiter(t, db, ratelimit.Config{Name: "loose", Limit: 100, Window: time.Hour})
	ctx := context.Background()
	// An allowed decision (Check.Cost left at its default) is allowed.
	m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
		ratelimit.Check{Limiter: strict, Key: "k"}, ratelimit.Check{Limiter: loose, Key: "k"})
	require.NoError(t, err)
	require.True(t, m.Allowed)
	require.Equal(t, int64(1), m.Decisions[1].Granted)
	for range 2 { // PostgreSQL denies, then the deny cache does
		m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
			ratelimit.Check{Limiter: strict, Key: "k"}, ratelimit.Check{Limiter: loose, Key: "k"})
		require.NoError(t, err)
		require.False(t, m.Allowed)
	}
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	samples, _ := scrape(t, srv.URL)
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="loose",outcome="not_counted",store="postgres"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="loose",outcome="not_counted",store="deny_cache"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="loose",outcome="allowed",store="postgres"}`], "only the allowed request's check is allowed")
	for k := range samples {
		if strings.Contains(k, `limiter="loose",outcome="allowed"`) {
			require.Contains(t, k, `store="postgres"`, "a refused request's check is not allowed")
		}
	}
}

// TestShadowDenialsCountedAsShadowDenied: a shadow-mode denial grants
// nothing (Granted 0) yet proceeds; it is counted as shadow_denied, never as
// not_counted or denied, whether the database, the deny cache, the memory
// tier of a MemoryLimiter or an all-or-nothing decision refused by another
// limit answered it, for single checks and partial grants alike.
func TestShadowDenialsCountedAsShadowDenied(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	reg := prometheus.NewRegistry()
	col, err := metrics.New(reg)
	require.NoError(t, err)
	at := func() time.Time { return base }
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	// One Database: the limits of one AllowAll.
	db := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Logger: quiet, Observer: col, Timeout: time.Minute, Now: at})
	shadow := testkit.Limiter(t, db, ratelimit.Config{Name: "shadow", Limit: 5, Window: time.Hour, Shadow: true})
	strict := testkit.Limiter(t, db, ratelimit.Config{Name: "strict", Limit: 1, Window: time.Hour})
	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "shadow-memory", Limit: 5, Window: time.Hour,
		Shadow: true}, ratelimit.MemoryOptions{Logger: quiet, Observer: col, Now: at})
	require.NoError(t, err)

	d, err := shadow.Allow(ctx, "k", ratelimit.Cost(5))
	require.NoError(t, err)
	require.Equal(t, int64(5), d.Granted)
	for range 2 { // PostgreSQL, then the deny cache
		d, err = shadow.Allow(ctx, "k", ratelimit.Cost(2))
		require.NoError(t, err)
		require.True(t, d.ShadowDenied)
		require.Zero(t, d.Granted)
	}
	d, err = shadow.Allow(ctx, "k", ratelimit.UpTo(4))
	require.NoError(t, err)
	require.True(t, d.ShadowDenied)
	require.Zero(t, d.Granted)
	_, err = strict.Allow(ctx, "k")
	require.NoError(t, err)
	m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
		ratelimit.Check{Limiter: shadow, Key: "k"}, ratelimit.Check{Limiter: strict, Key: "k"})
	require.NoError(t, err)
	require.False(t, m.Allowed)
	require.True(t, m.Decisions[0].ShadowDenied)
	require.Zero(t, m.Decisions[0].Granted)
	for _, n := range []int64{5, 2, 2} {
		_, err = mem.Allow(ctx, "k", ratelimit.Cost(n))
		require.NoError(t, err)
	}
	d, err = mem.Allow(ctx, "k", ratelimit.UpTo(4))
	require.NoError(t, err)
	require.True(t, d.ShadowDenied)

	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	samples, _ := scrape(t, srv.URL)
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="shadow",outcome="allowed",store="postgres"}`])
	require.Equal(t, "3", samples[`pgrl_decisions_total{limiter="shadow",outcome="shadow_denied",store="postgres"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="shadow",outcome="shadow_denied",store="deny_cache"}`])
	require.Equal(t, "1", samples[`pgrl_decisions_total{limiter="shadow-memory",outcome="allowed",store="memory"}`])
	require.Equal(t, "3", samples[`pgrl_decisions_total{limiter="shadow-memory",outcome="shadow_denied",store="memory"}`])
	for k := range samples {
		if strings.Contains(k, `limiter="shadow`) {
			require.NotContains(t, k, `outcome="not_counted"`, "a shadow denial is a shadow denial")
			require.NotContains(t, k, `outcome="denied"`, "shadow mode never denies")
		}
	}
}
