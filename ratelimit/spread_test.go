package ratelimit_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestSpreadAccuracy measures the documented trade-off of spreading a hot
// key over several rows: the total admitted never exceeds Limit and reaches
// it exactly once every row has been exhausted, but the first denial can
// come before Limit is reached.
func TestSpreadAccuracy(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		const limit, spread = 100, 8
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "global-" + string(alg), Algorithm: alg, Limit: limit,
			Window: time.Hour, Spread: spread, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
		var admitted, firstDeny atomic.Int64
		var attempts atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 100 {
					n := attempts.Add(1)
					d, err := l.Allow(ctx, "all")
					if err != nil {
						t.Error(err)
						return
					}
					require.Equal(t, int64(limit), d.Limit)
					if d.Allowed {
						admitted.Add(1)
					} else {
						firstDeny.CompareAndSwap(0, admitted.Load())
						_ = n
					}
				}
			})
		}
		wg.Wait()
		require.Equal(t, int64(limit), admitted.Load(), "%s: 800 attempts exhaust every row: exactly Limit admitted", alg)
		t.Logf("%s: first denial after %d admissions (limit %d, spread %d)", alg, firstDeny.Load(), limit, spread)
		require.GreaterOrEqual(t, firstDeny.Load(), int64(limit*8/10), "%s: the first denial comes near the limit", alg)

		p, err := l.Peek(ctx, "all")
		require.NoError(t, err)
		require.Equal(t, int64(0), p.Remaining)
		require.False(t, p.Allowed)
		require.NoError(t, l.Reset(ctx, "all"))
		p, err = l.Peek(ctx, "all")
		require.NoError(t, err)
		require.Equal(t, int64(limit), p.Remaining)
	}
	_, err := testkit.New(pool, ratelimit.Config{Name: "tiny", Limit: 3, Window: time.Minute, Spread: 4})
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "cost", Limit: 100, Window: time.Minute, Spread: 4})
	_, err = l.Allow(ctx, "k", ratelimit.Cost(26))
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
}
