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

func TestAllowAllOrNothing(t *testing.T) {
	t.Parallel()
	for _, v := range dbVariants() {
		if v.name == "tx" {
			continue // a denial aborts the caller's transaction; covered by its own test
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			db := v.open(t)
			ctx := context.Background()
			perIP := testkit.NewLimiter(t, db, ratelimit.Config{Name: "ip", Limit: 2, Window: time.Minute, DenyCacheSize: -1, Now: testkit.Pinned(base)})
			perEmail := testkit.NewLimiter(t, db, ratelimit.Config{Name: "email", Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Minute, Now: testkit.Pinned(base)})
			global := testkit.NewLimiter(t, db, ratelimit.Config{Name: "global", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour, Now: testkit.Pinned(base)})

			for i := range 2 {
				m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
					ratelimit.Check{Limiter: perIP, Key: "1.2.3.4"},
					ratelimit.Check{Limiter: perEmail, Key: "a@example.com"},
					ratelimit.Check{Limiter: global, Key: "all"})
				require.NoError(t, err)
				require.True(t, m.Allowed, "decision %d", i)
				require.Equal(t, -1, m.DeniedBy)
				for _, d := range m.Decisions {
					require.Equal(t, ratelimit.StorePostgres, d.Store)
				}
			}
			m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
				ratelimit.Check{Limiter: perIP, Key: "1.2.3.4"},
				ratelimit.Check{Limiter: perEmail, Key: "a@example.com"},
				ratelimit.Check{Limiter: global, Key: "all"})
			require.NoError(t, err)
			require.False(t, m.Allowed)
			require.Equal(t, 0, m.DeniedBy)
			require.Positive(t, m.RetryAfter())

			// Nothing was consumed by the denied decision.
			d, err := perEmail.Peek(ctx, "a@example.com")
			require.NoError(t, err)
			require.Equal(t, int64(3), d.Remaining)
			d, err = global.Peek(ctx, "all")
			require.NoError(t, err)
			require.Equal(t, int64(98), d.Remaining)

			// ConsumeAll counts the attempt against the limits that allowed it.
			m, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll,
				ratelimit.Check{Limiter: perIP, Key: "1.2.3.4"},
				ratelimit.Check{Limiter: global, Key: "all", Cost: 3})
			require.NoError(t, err)
			require.False(t, m.Allowed)
			d, err = global.Peek(ctx, "all")
			require.NoError(t, err)
			require.Equal(t, int64(95), d.Remaining)
		})
	}
}

func TestAllowAllBadInputs(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	other, _ := dbtest.Pool(t)
	ctx := context.Background()
	a := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "a", Limit: 2, Window: time.Minute, Now: testkit.Pinned(base)})
	b := testkit.NewLimiter(t, other, ratelimit.Config{Name: "b", Limit: 2, Window: time.Minute, Now: testkit.Pinned(base)})

	_, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing)
	require.ErrorIs(t, err, ratelimit.ErrEmptyMulti)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k"}, ratelimit.Check{Limiter: a, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrDuplicateCheck)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k"}, ratelimit.Check{Limiter: b, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrMixedDatabases)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k", Cost: 3})
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k", Cost: -1})
	require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrNilLimiter)

	// Nothing was consumed by any refused call.
	d, err := a.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(2), d.Remaining)
}

// TestAllowAllSameAlgorithm covers decisions whose limits all use one
// algorithm (the other tables get no keys).
func TestAllowAllSameAlgorithm(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		a := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "same-a-" + string(alg), Algorithm: alg, Limit: 1, Window: time.Hour, DenyCacheSize: -1, Now: testkit.Pinned(base)})
		b := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "same-b-" + string(alg), Algorithm: alg, Limit: 2, Window: time.Hour, DenyCacheSize: -1, Now: testkit.Pinned(base)})
		m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k"}, ratelimit.Check{Limiter: b, Key: "k"})
		require.NoError(t, err)
		require.True(t, m.Allowed, alg)
		m, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k"}, ratelimit.Check{Limiter: b, Key: "k"})
		require.NoError(t, err)
		require.False(t, m.Allowed, alg)
		require.Equal(t, 0, m.DeniedBy)
		d, err := b.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(1), d.Remaining, "%s: the first decision counted, the denied one did not", alg)
	}
}
