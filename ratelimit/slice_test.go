package ratelimit_test

import (
	"context"
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// The statement sizes a slice from what the key has left: ceil(left/share),
// at least min, at most n; the last units go one at a time; fewer than min
// left is a denial that counts nothing, or min under Penalty.
func TestSliceIsAFairShareOfWhatIsLeft(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "slice", Algorithm: alg, Limit: 100,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			// left 100, share 4: 25 (below n 40); left 75: 19; left 56: 14 ...
			want := []int64{25, 19, 14, 11, 8, 6, 5, 3, 3, 2, 1, 1, 1, 1}
			var got []int64
			total := int64(0)
			for range want {
				d, err := l.Allow(ctx, "k", ratelimit.Slice(1, 40, 4))
				require.NoError(t, err)
				require.True(t, d.Allowed)
				require.Equal(t, ratelimit.StorePostgres, d.Store)
				got = append(got, d.Granted)
				total += d.Granted
				require.Equal(t, 100-total, d.Remaining)
			}
			require.Equal(t, want, got)
			d, err := l.Allow(ctx, "k", ratelimit.Slice(1, 40, 4))
			require.NoError(t, err)
			require.False(t, d.Allowed)
			require.Zero(t, d.Granted)
			require.Positive(t, d.RetryAfter)

			// n caps the share; min lifts it; share 1 grants all that is
			// left up to n.
			d, err = l.Allow(ctx, "other", ratelimit.Slice(1, 10, 2))
			require.NoError(t, err)
			require.Equal(t, int64(10), d.Granted)
			d, err = l.Allow(ctx, "other", ratelimit.Slice(70, 100, 1000))
			require.NoError(t, err)
			require.Equal(t, int64(70), d.Granted)
			d, err = l.Allow(ctx, "other", ratelimit.Slice(1, 100, 1))
			require.NoError(t, err)
			require.Equal(t, int64(20), d.Granted)

			// Fewer than min left: denied, nothing counted.
			_, err = l.Allow(ctx, "few", ratelimit.Cost(97))
			require.NoError(t, err)
			d, err = l.Allow(ctx, "few", ratelimit.Slice(5, 50, 8))
			require.NoError(t, err)
			require.False(t, d.Allowed)
			require.Zero(t, d.Granted)
			require.Equal(t, int64(3), d.Remaining)
			d, err = l.Allow(ctx, "few", ratelimit.Slice(3, 50, 8))
			require.NoError(t, err)
			require.Equal(t, int64(3), d.Granted)
		})
		if alg == ratelimit.TokenBucket {
			continue // a penalised token bucket takes no slice: TestSliceRefusals
		}
		t.Run(string(alg)+"/penalty", func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "slice-penalty", Algorithm: alg, Limit: 100,
				Window: time.Hour, Penalty: true, DenyCacheSize: -1},
				ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			// Granted slices count what they grant, as without penalty.
			d, err := l.Allow(ctx, "k", ratelimit.Slice(1, 90, 1))
			require.NoError(t, err)
			require.Equal(t, int64(90), d.Granted)
			d, err = l.Allow(ctx, "k", ratelimit.Slice(2, 90, 1))
			require.NoError(t, err)
			require.Equal(t, int64(10), d.Granted)
			require.Equal(t, int64(100), d.Used)
			// A denied slice counts min, the asking check's cost, not n.
			d, err = l.Allow(ctx, "k", ratelimit.Slice(3, 90, 1))
			require.NoError(t, err)
			require.False(t, d.Allowed)
			require.Zero(t, d.Granted)
			p, err := l.Peek(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, int64(103), p.Used)
		})
	}
}

// Slices taken at once by many goroutines never grant more than the limit
// in all, and each is at most ceil(left/share) of what was left.
func TestSliceConcurrentNeverOverGrants(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "slice-race", Algorithm: alg, Limit: 1000,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			var mu sync.Mutex
			total := int64(0)
			var wg sync.WaitGroup
			for range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						d, err := l.Allow(ctx, "hot", ratelimit.Slice(1, 100, 8))
						if err != nil {
							t.Error(err)
							return
						}
						if !d.Allowed {
							return
						}
						// Remaining is what was left after this slice.
						left := d.Remaining + d.Granted
						if d.Granted > min(int64(100), max(1, (left+7)/8)) {
							t.Errorf("slice of %d with %d left", d.Granted, left)
						}
						mu.Lock()
						total += d.Granted
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			require.Equal(t, int64(1000), total)
		})
	}
}

func TestSliceRefusals(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "slice-bad", Limit: 10, Window: time.Hour})
	for _, c := range []struct {
		opt  ratelimit.Option
		want error
	}{
		{ratelimit.Slice(0, 5, 2), ratelimit.ErrInvalidCost},
		{ratelimit.Slice(-1, 5, 2), ratelimit.ErrInvalidCost},
		{ratelimit.Slice(6, 5, 2), ratelimit.ErrInvalidCost},
		{ratelimit.Slice(1, 0, 2), ratelimit.ErrInvalidCost},
		{ratelimit.Slice(11, 20, 2), ratelimit.ErrCostExceedsLimit},
		{ratelimit.Slice(1, 5, 0), ratelimit.ErrInvalidOption},
		{ratelimit.Slice(1, 5, -3), ratelimit.ErrInvalidOption},
	} {
		_, err := l.Allow(ctx, "k", c.opt)
		require.ErrorIs(t, err, c.want, "%+v", c.opt.Value())
	}
	_, err := l.Allow(ctx, "k", ratelimit.Slice(1, 5, 2), ratelimit.Cost(1))
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	_, err = l.Peek(ctx, "k", ratelimit.Slice(1, 5, 2))
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)

	for _, cfg := range []ratelimit.Config{
		{Name: "slice-spread", Limit: 10, Window: time.Hour, Spread: 2},
		{Name: "slice-tb-penalty", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Hour, Penalty: true},
		{Name: "slice-policy", Limit: 10, Window: time.Hour, Policy: "p"},
	} {
		l := testkit.NewLimiter(t, pool, cfg)
		_, err := l.Allow(ctx, "k", ratelimit.Slice(1, 5, 2))
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption, cfg.Name)
	}
	m, err := ratelimit.NewMemory(ratelimit.Config{Name: "slice-mem", Limit: 10, Window: time.Hour}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	_, err = m.Allow(ctx, "k", ratelimit.Slice(1, 5, 2))
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.False(t, errors.Is(err, ratelimit.ErrInvalidCost))
}

// Huge values saturate, as for UpTo: n is capped at the capacity, the
// probe at the largest bigint, and a share above what is left grants min.
func TestSliceHugeValues(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "slice-huge", Algorithm: alg, Limit: 100,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			d, err := l.Allow(ctx, "k", ratelimit.Slice(1, math.MaxInt64, math.MaxInt64))
			require.NoError(t, err)
			require.Equal(t, int64(1), d.Granted, "a share of what is left rounds up to min")
			d, err = l.Allow(ctx, "k", ratelimit.Slice(2, math.MaxInt64, 1))
			require.NoError(t, err)
			require.Equal(t, int64(99), d.Granted, "all that is left")
			_, err = l.Allow(ctx, "k", ratelimit.Slice(math.MaxInt64, math.MaxInt64, 1))
			require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
		})
	}
}
