package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// A per-call rate with the limiter's window shares its counter; another
// window counts apart, even where both windows end at the same instant.
func TestAllowRateWindows(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	// base is 03:04:00, so [03:05, 03:06) ends where the 2-minute window
	// [03:04, 03:06) ends.
	c := testkit.NewClock(base.Add(70 * time.Second))
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) {
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate-" + string(alg), Algorithm: alg, Limit: 3, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
			d, err := l.Allow(ctx, "k", ratelimit.Cost(3))
			require.NoError(t, err)
			require.True(t, d.Allowed)
			d, err = l.Allow(ctx, "k")
			require.NoError(t, err)
			require.False(t, d.Allowed)

			// Same window, higher limit: the 3 already used count.
			more := ratelimit.Rate{Limit: 5, Window: time.Minute}
			d, err = l.Allow(ctx, "k", ratelimit.Cost(2), ratelimit.AtRate(more))
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, int64(5), d.Used)
			require.Equal(t, int64(5), d.Limit)
			d, err = l.Allow(ctx, "k", ratelimit.AtRate(more))
			require.NoError(t, err)
			require.False(t, d.Allowed)
			p, err := l.Peek(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, int64(5), p.Used, "the limiter's own rows hold the per-call counts")

			// Another window: a counter of its own.
			other := ratelimit.Rate{Limit: 2, Window: 2 * time.Minute}
			d, err = l.Allow(ctx, "k", ratelimit.AtRate(other))
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, int64(1), d.Used)
			p, err = l.Peek(ctx, "k", ratelimit.AtRate(other))
			require.NoError(t, err)
			require.Equal(t, int64(1), p.Used)
			p, err = l.Peek(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, int64(5), p.Used)

			// The other window's rows are the name's RateName.
			named := testkit.NewLimiter(t, pool, ratelimit.Config{Name: ratelimit.RateName(l.Config().Name, 2*time.Minute), Algorithm: alg, Limit: 2, Window: 2 * time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
			p, err = named.Peek(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, int64(1), p.Used)

			require.NoError(t, l.Reset(ctx, "k", ratelimit.AtRate(other)))
			p, err = l.Peek(ctx, "k", ratelimit.AtRate(other))
			require.NoError(t, err)
			require.Equal(t, int64(0), p.Used)
		})
	}
}

// A token bucket keeps one balance per key whatever the rate: a higher rate
// does not hand out fresh tokens.
func TestAllowRateTokenBucketSharesTheBalance(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate-tb", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	d, err := l.Allow(ctx, "k", ratelimit.Cost(10))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	big := ratelimit.Rate{Limit: 100, Window: time.Hour, Burst: 100}
	d, err = l.Allow(ctx, "k", ratelimit.AtRate(big))
	require.NoError(t, err)
	require.False(t, d.Allowed, "the bucket is empty at any rate")
	require.Equal(t, int64(100), d.Limit)
	c.Add(36 * time.Second) // 1 token at 100 per hour, 6 at 10 per minute
	d, err = l.Allow(ctx, "k", ratelimit.AtRate(big))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	d, err = l.Allow(ctx, "k", ratelimit.AtRate(big))
	require.NoError(t, err)
	require.False(t, d.Allowed)
}

// A rate is validated as Config is, with the same errors; the limiter's own
// rate is the limiter itself, and a rate is built once.
func TestWithRate(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate-v", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Minute})
	same, err := l.WithRate(ratelimit.Rate{Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	require.Same(t, l, same)
	r := ratelimit.Rate{Limit: 20, Window: time.Minute}
	a, err := l.WithRate(r)
	require.NoError(t, err)
	b, err := l.WithRate(r)
	require.NoError(t, err)
	require.Same(t, a, b)
	require.Equal(t, int64(20), a.Config().Burst)
	require.Equal(t, "rate-v", a.Config().Name, "a token bucket keeps its name at any window")

	for _, tc := range []struct {
		r    ratelimit.Rate
		want error
	}{
		{ratelimit.Rate{Limit: 0, Window: time.Minute}, ratelimit.ErrInvalidLimit},
		{ratelimit.Rate{Limit: 1, Window: 0}, ratelimit.ErrInvalidWindow},
		{ratelimit.Rate{Limit: 1, Window: 400 * 24 * time.Hour}, ratelimit.ErrInvalidWindow},
		{ratelimit.Rate{Limit: 1, Window: time.Minute, Burst: -1}, ratelimit.ErrInvalidBurst},
		{ratelimit.Rate{Limit: 1, Window: time.Minute, Burst: ratelimit.MaxTokens + 1}, ratelimit.ErrInvalidBurst},
	} {
		_, err := l.Allow(ctx, "k", ratelimit.AtRate(tc.r))
		require.ErrorIs(t, err, tc.want, "%+v", tc.r)
	}
	_, err = l.Allow(ctx, "k", ratelimit.Cost(30), ratelimit.AtRate(r))
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
}

// The Observer sees the limiter's own name at every rate, also where the
// counters use RateName.
func TestAllowRateObservedUnderTheLimitersName(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	obs := &testkit.Observer{}
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate-obs", Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Observer: obs, Now: testkit.Pinned(base)})
	_, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k", ratelimit.AtRate(ratelimit.Rate{Limit: 5, Window: time.Hour}))
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k", ratelimit.AtRate(ratelimit.Rate{Limit: 5, Window: time.Minute}))
	require.NoError(t, err)
	require.Equal(t, []string{"rate-obs", "rate-obs", "rate-obs"}, obs.Names())
}

// Two limiters of one name at two windows that end at the same instant
// share a fixed-window row unless KeyByWindow keys the counters by window:
// then a new window always starts afresh, and a per-call rate at another
// window keeps the limiter's name.
func TestKeyByWindow(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	// At 03:04 the hour [03:00, 04:00) and the two hours [02:00, 04:00)
	// both end at 04:00.
	now := testkit.Pinned(base)
	for _, byWindow := range []bool{false, true} {
		name := "kbw-" + map[bool]string{false: "name", true: "window"}[byWindow]
		hourly := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Limit: 3, Window: time.Hour, KeyByWindow: byWindow}, ratelimit.DatabaseOptions{Now: now})
		d, err := hourly.Allow(ctx, "k", ratelimit.Cost(3))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		twoHourly := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Limit: 5, Window: 2 * time.Hour, KeyByWindow: byWindow}, ratelimit.DatabaseOptions{Now: now})
		d, err = twoHourly.Allow(ctx, "k")
		require.NoError(t, err)
		if byWindow {
			require.Equal(t, int64(1), d.Used, "a new window starts afresh")
		} else {
			require.Equal(t, int64(4), d.Used, "without KeyByWindow the windows share their row")
		}
		if byWindow {
			other, err := hourly.WithRate(ratelimit.Rate{Limit: 5, Window: 2 * time.Hour})
			require.NoError(t, err)
			require.Equal(t, name, other.Config().Name)
			p, err := other.Peek(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, int64(1), p.Used, "the rate at two hours reaches the two-hour limiter's rows")
		}
	}
}
