package ratelimit_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestShadowModeNeverDenies: a shadow limiter over its limit allows, sets
// ShadowDenied, logs (at most once a second), and still counts like the
// real limit would, for every algorithm.
func TestShadowModeNeverDenies(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		logs := &testkit.LogBuffer{}
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "shadow-" + string(alg), Algorithm: alg, Limit: 2, Window: time.Hour, Shadow: true}, ratelimit.DatabaseOptions{Logger: slog.New(slog.NewTextHandler(logs, nil)), Now: testkit.Pinned(base)})
		for i := range 2 {
			d, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.False(t, d.ShadowDenied, "%s check %d is within the limit", alg, i)
		}
		require.Empty(t, logs.String(), "nothing to log while within the limit")
		for i := range 5 {
			d, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.True(t, d.Allowed, "%s: shadow mode never denies", alg)
			require.True(t, d.ShadowDenied, "%s check %d: the limit would have denied", alg, i)
			require.Zero(t, d.RetryAfter)
			require.Contains(t, []ratelimit.Store{ratelimit.StorePostgres, ratelimit.StoreDenyCache}, d.Store)
		}
		out := logs.String()
		require.Equal(t, 1, strings.Count(out, "shadow limit would have denied"), "logged once for a burst:\n%s", out)
		require.Contains(t, out, "limiter=shadow-"+string(alg))
		// The real limit's view: exhausted.
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		require.False(t, p.Allowed, "%s: the shadow limiter counted like the real one", alg)
	}
}

// TestShadowModeInMultiLimit: a shadow limiter in an all-or-nothing decision
// neither denies the request nor vetoes the other limits' consumption.
func TestShadowModeInMultiLimit(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	logs := &testkit.LogBuffer{}
	// One Database: the limits of one AllowAll.
	db := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Logger: slog.New(slog.NewTextHandler(logs, nil)), Now: testkit.Pinned(base)})
	shadow := testkit.Limiter(t, db, ratelimit.Config{Name: "new-limit", Limit: 1, Window: time.Hour, Shadow: true})
	real := testkit.Limiter(t, db, ratelimit.Config{Name: "old-limit", Algorithm: ratelimit.SlidingWindow, Limit: 10, Window: time.Hour})
	// One voting limit of each algorithm: see TestMultiSingleAlgorithmConsumes
	// in package tests for decisions that lack one.
	perIP := testkit.Limiter(t, db, ratelimit.Config{Name: "per-ip", Limit: 10, Window: time.Hour})
	global := testkit.Limiter(t, db, ratelimit.Config{Name: "global", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour})
	for i := range 3 {
		m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: shadow, Key: "k"},
			ratelimit.Check{Limiter: real, Key: "k"}, ratelimit.Check{Limiter: perIP, Key: "k"}, ratelimit.Check{Limiter: global, Key: "k"})
		require.NoError(t, err)
		require.True(t, m.Allowed, "decision %d", i)
		require.Equal(t, i > 0, m.Decisions[0].ShadowDenied, "decision %d", i)
	}
	d, err := real.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(7), d.Remaining, "the real limit counted all three decisions")
	require.Contains(t, logs.String(), "shadow limit would have denied")
}

// TestResilienceBadConfig: bad failure-policy settings give typed errors.
func TestResilienceBadConfig(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ok := ratelimit.Config{Name: "x", Limit: 5, Window: time.Minute}
	for _, tc := range []struct {
		name string
		mod  func(*ratelimit.Config, *ratelimit.DatabaseOptions)
		want error
	}{
		{"unknown policy", func(c *ratelimit.Config, _ *ratelimit.DatabaseOptions) { c.OnFailure = ratelimit.FailurePolicy(42) }, ratelimit.ErrInvalidPolicy},
		{"negative fallback limit", func(c *ratelimit.Config, _ *ratelimit.DatabaseOptions) { c.FallbackLimit = -1 }, ratelimit.ErrInvalidLimit},
		{"negative timeout", func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.Timeout = -time.Second }, ratelimit.ErrInvalidTimeout},
		{"negative breaker threshold", func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.BreakerThreshold = -1 }, ratelimit.ErrInvalidOption},
		{"negative breaker cooldown", func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.BreakerCooldown = -time.Millisecond }, ratelimit.ErrInvalidTimeout},
		{"negative max batch", func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.MaxBatch = -1 }, ratelimit.ErrInvalidOption},
		{"negative max in flight", func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.MaxInFlight = -1 }, ratelimit.ErrInvalidOption},
		{"negative spread", func(c *ratelimit.Config, _ *ratelimit.DatabaseOptions) { c.Spread = -1 }, ratelimit.ErrInvalidOption},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			var o ratelimit.DatabaseOptions
			tc.mod(&c, &o)
			_, err := testkit.New(pool, c, o)
			require.ErrorIs(t, err, tc.want)
		})
	}
	l := testkit.NewLimiter(t, pool, ok)
	c := l.Config()
	o := ratelimit.OptionsOf(l)
	require.Equal(t, ratelimit.FailToMemory, c.OnFailure)
	require.Equal(t, int64(5), c.FallbackLimit)
	require.Equal(t, 5, o.BreakerThreshold)
	require.Equal(t, 500*time.Millisecond, o.BreakerCooldown)
	require.Equal(t, 10_000, c.DenyCacheSize)
}
