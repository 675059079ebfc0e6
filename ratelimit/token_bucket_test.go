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

func TestTokenBucketSequence(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	// 10 tokens per second, capacity 5.
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Second, Burst: 5}, ratelimit.DatabaseOptions{Now: c.Now})

	d, err := l.Allow(ctx, "k", ratelimit.Cost(5))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining)
	require.Equal(t, int64(5), d.Limit)
	require.Equal(t, base.Add(500*time.Millisecond), d.ResetAt.UTC())

	d, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, 100*time.Millisecond, d.RetryAfter)
	require.Equal(t, int64(1), d.RetryAfterSeconds())

	c.Add(250 * time.Millisecond) // 2.5 tokens back
	d, err = l.Allow(ctx, "k", ratelimit.Cost(2))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(0), d.Remaining) // 0.5 left
	d, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, 50*time.Millisecond, d.RetryAfter)

	// Refill never exceeds the capacity.
	c.Add(time.Hour)
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.True(t, p.Allowed)
	require.Equal(t, int64(5), p.Remaining)
}

func TestTokenBucketPenalty(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tbp", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Second, Burst: 2, Penalty: true}, ratelimit.DatabaseOptions{Now: c.Now})
	for range 2 {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
	}
	for range 5 {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, d.Allowed)
	}
	// The balance went into debt, bounded at -Burst (-2). After 2.5 s it
	// is 0.5: still short, and this attempt is charged too (-0.5), so the
	// next token is 1.5 s away.
	c.Add(2500 * time.Millisecond)
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, 1500*time.Millisecond, d.RetryAfter)
}
