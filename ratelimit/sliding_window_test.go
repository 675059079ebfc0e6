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

func TestSlidingWindowSequence(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base.Add(30 * time.Second))
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "sw", Algorithm: ratelimit.SlidingWindow, Limit: 10, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})

	d, err := l.Allow(ctx, "k", ratelimit.Cost(10))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining)

	// A quarter into the next window the previous window still weighs 3/4:
	// estimate 7.5, so 2 more fit and 3 do not.
	c.Set(base.Add(time.Minute + 15*time.Second))
	d, err = l.Allow(ctx, "k", ratelimit.Cost(3))
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, int64(2), d.Remaining)
	// 3 fit once the previous window's weight is 0.7: at 18 s in.
	require.Equal(t, 3*time.Second, d.RetryAfter)

	d, err = l.Allow(ctx, "k", ratelimit.Cost(2))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining) // 7.5 + 2 = 9.5

	// Two windows later everything is forgotten.
	c.Set(base.Add(3*time.Minute + time.Second))
	d, err = l.Allow(ctx, "k", ratelimit.Cost(10))
	require.NoError(t, err)
	require.True(t, d.Allowed)
}
