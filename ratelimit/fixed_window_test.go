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

func TestFixedWindowSequence(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "fw", Limit: 3, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})

	for i := 1; i <= 3; i++ {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed, "check %d", i)
		require.Equal(t, int64(3-i), d.Remaining)
		require.Equal(t, base.Add(time.Minute), d.ResetAt.UTC())
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.Zero(t, d.RetryAfter)
	}
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining)
	require.Equal(t, 50*time.Second, d.RetryAfter)
	require.Equal(t, int64(50), d.RetryAfterSeconds())

	// Denied checks consume nothing by default: a peek still sees 3.
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.False(t, p.Allowed)
	require.Equal(t, int64(0), p.Remaining)

	// Another key and another limiter name are independent.
	d, err = l.Allow(ctx, "other")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	l2 := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "fw2", Limit: 3, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	d, err = l2.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(2), d.Remaining)

	// The next window starts afresh.
	c.Set(base.Add(time.Minute))
	d, err = l.Allow(ctx, "k", ratelimit.Cost(3))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining)
	require.Equal(t, base.Add(2*time.Minute), d.ResetAt.UTC())

	// Reset forgets the key.
	require.NoError(t, l.Reset(ctx, "k"))
	d, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(2), d.Remaining)
}

func TestFixedWindowPenalty(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "fwp", Limit: 2, Window: time.Minute, Penalty: true}, ratelimit.DatabaseOptions{Now: c.Now})
	var allowed int
	for range 5 {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		if d.Allowed {
			allowed++
		}
	}
	require.Equal(t, 2, allowed)
	var count int64
	require.NoError(t, pool.QueryRow(ctx, "SELECT count FROM pgrl_fixed_window").Scan(&count))
	require.Equal(t, int64(5), count, "penalty mode counts every attempt")
}
