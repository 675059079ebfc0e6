package ratelimit_test

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// used is what key of l has used, by Peek.
func used(t *testing.T, l *ratelimit.Limiter, key string) int64 {
	t.Helper()
	d, err := l.Peek(context.Background(), key)
	require.NoError(t, err)
	return d.Used
}

// A reservation takes its estimate; its settlement refunds what the actual
// cost left over or charges its excess past the limit, with the overage
// reported; settling again changes nothing; a denied reservation settles
// as one of nothing. Every algorithm, at one pinned instant.
func TestSettleRefundsAndCharges(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "settle-" + string(alg), Algorithm: alg, Limit: 10,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			d, err := l.Reserve(ctx, "k", "r1", 6)
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.EqualValues(t, 6, d.Granted)
			again, err := l.Reserve(ctx, "k", "r1", 6)
			require.NoError(t, err)
			require.True(t, again.Replayed, "a reservation is made once")
			require.EqualValues(t, 6, used(t, l, "k"))

			s, err := l.Settle(ctx, "k", "r1", 2)
			require.NoError(t, err)
			require.Equal(t, ratelimit.Settlement{Reserved: 6, Actual: 2, Refunded: 4}, s)
			require.EqualValues(t, 2, used(t, l, "k"), "the difference refunded")
			for _, actual := range []int64{2, 9, 0} {
				s, err = l.Settle(ctx, "k", "r1", actual)
				require.NoError(t, err)
				require.Equal(t, ratelimit.Settlement{Reserved: 6, Actual: 2, Refunded: 4, Replayed: true}, s)
			}
			require.EqualValues(t, 2, used(t, l, "k"), "settled once")

			d, err = l.Reserve(ctx, "k", "r2", 5)
			require.NoError(t, err)
			require.True(t, d.Allowed)
			s, err = l.Settle(ctx, "k", "r2", 12)
			require.NoError(t, err)
			require.Equal(t, ratelimit.Settlement{Reserved: 5, Actual: 12, Charged: 7, Overage: 4}, s,
				"3 units were left when 7 were charged")
			require.EqualValues(t, 14, used(t, l, "k"), "charged past the limit")

			d, err = l.Reserve(ctx, "k", "r3", 1)
			require.NoError(t, err)
			require.False(t, d.Allowed)
			s, err = l.Settle(ctx, "k", "r3", 1)
			require.NoError(t, err)
			require.Equal(t, ratelimit.Settlement{Reserved: 0, Actual: 1, Charged: 1, Overage: 1}, s,
				"work done under a denied reservation is all charged")
			require.EqualValues(t, 15, used(t, l, "k"))

			// Ids are the key's and the limiter's: nothing else settles.
			for _, c := range []struct{ key, id string }{{"k", "nope"}, {"other", "r2"}} {
				_, err = l.Settle(ctx, c.key, c.id, 1)
				require.ErrorIs(t, err, ratelimit.ErrReservationNotFound)
				require.Equal(t, ratelimit.OutcomeNotConsumed, ratelimit.OutcomeOf(err))
			}
			// A request id is not a reservation.
			_, err = l.Allow(ctx, "k", ratelimit.RequestID("r4"))
			require.NoError(t, err)
			_, err = l.Settle(ctx, "k", "r4", 1)
			require.ErrorIs(t, err, ratelimit.ErrReservationNotFound)
			require.EqualValues(t, 15, used(t, l, "k"), "the check was denied: the key is over its limit")
		})
	}
}

// A reservation that is not settled within the limiter's Window lapses at
// its estimate; a fixed window's units are refunded only while their
// window lasts.
func TestSettleLapses(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			clock := testkit.NewClock(base.Add(time.Minute))
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "lapse-" + string(alg), Algorithm: alg, Limit: 100,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: clock.Now})
			_, err := l.Reserve(ctx, "k", "late", 30)
			require.NoError(t, err)
			clock.Add(time.Hour)
			_, err = l.Settle(ctx, "k", "late", 0)
			require.ErrorIs(t, err, ratelimit.ErrReservationLapsed)
			require.Equal(t, ratelimit.OutcomeNotConsumed, ratelimit.OutcomeOf(err))
			require.Contains(t, err.Error(), "lapsed 0s ago")
			if alg == ratelimit.TokenBucket {
				return // the bucket refilled in the hour: its estimate is spent
			}
			if alg == ratelimit.SlidingWindow {
				// One window on, the estimate weighs on the next window:
				// 30 × 55/60, rounded up.
				require.EqualValues(t, 28, used(t, l, "k"), "the estimate stays counted")
				return
			}
			// A fixed window reservation made near its window's end,
			// settled after it: the ended window's units are not given
			// back (they no longer count), an excess is charged now.
			clock.Set(time.Date(2030, 1, 2, 5, 59, 59, 0, time.UTC))
			_, err = l.Reserve(ctx, "k", "edge", 40)
			require.NoError(t, err)
			clock.Add(time.Minute)
			s, err := l.Settle(ctx, "k", "edge", 10)
			require.NoError(t, err)
			require.Equal(t, ratelimit.Settlement{Reserved: 40, Actual: 10}, s)
			require.EqualValues(t, 0, used(t, l, "k"))
			_, err = l.Reserve(ctx, "k", "edge2", 40)
			require.NoError(t, err)
			s, err = l.Settle(ctx, "k", "edge2", 50)
			require.NoError(t, err)
			require.Equal(t, ratelimit.Settlement{Reserved: 40, Actual: 50, Charged: 10}, s)
			require.EqualValues(t, 50, used(t, l, "k"))
		})
	}
}

// Copies of one settlement sent at once from several pools (as several
// instances would send them) settle it once: one makes it, the others
// return it.
func TestSettleConcurrentCopies(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			cfg := ratelimit.Config{Name: "settle-copies-" + string(alg), Algorithm: alg, Limit: 1000,
				Window: time.Hour, DenyCacheSize: -1}
			opts := ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))}
			var lims []*ratelimit.Limiter
			for range 3 {
				lims = append(lims, testkit.NewLimiter(t, dbtest.PoolOn(t, s), cfg, opts))
			}
			const ids = 20
			for i := range ids {
				_, err := lims[0].Reserve(ctx, "k", fmt.Sprint(i), 10)
				require.NoError(t, err)
			}
			var mu sync.Mutex
			made := map[int]int{}
			var wg sync.WaitGroup
			for _, l := range lims {
				for range 2 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := range ids {
							st, err := l.Settle(ctx, "k", fmt.Sprint(i), int64(i))
							if err != nil {
								t.Error(err)
								return
							}
							if !st.Replayed {
								mu.Lock()
								made[i]++
								mu.Unlock()
							}
						}
					}()
				}
			}
			wg.Wait()
			want := map[int]int{}
			sum := int64(0)
			for i := range ids {
				want[i] = 1
				sum += int64(i)
			}
			require.Equal(t, want, made, "each settlement made once")
			require.EqualValues(t, sum, used(t, lims[1], "k"))
		})
	}
}

// Bad input is refused before anything is sent, and names the fix.
func TestSettleRefusals(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "settle-refusals", Algorithm: ratelimit.FixedWindow, Limit: 10,
		Window: time.Hour})
	spread := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "settle-spread", Limit: 10, Window: time.Hour, Spread: 2})
	penalty := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "settle-penalty", Limit: 10, Window: time.Hour, Penalty: true})
	long := string(make([]byte, ratelimit.MaxRequestIDLength+1))
	for _, c := range []struct {
		name string
		err  error
		f    func() error
	}{
		{"empty id", ratelimit.ErrInvalidOption, func() error { _, err := l.Reserve(ctx, "k", "", 1); return err }},
		{"long id", ratelimit.ErrInvalidOption, func() error { _, err := l.Settle(ctx, "k", long, 1); return err }},
		{"zero estimate", ratelimit.ErrInvalidCost, func() error { _, err := l.Reserve(ctx, "k", "a", 0); return err }},
		{"estimate above the limit", ratelimit.ErrCostExceedsLimit, func() error { _, err := l.Reserve(ctx, "k", "a", 11); return err }},
		{"negative actual", ratelimit.ErrInvalidCost, func() error { _, err := l.Settle(ctx, "k", "a", -1); return err }},
		{"spread", ratelimit.ErrInvalidOption, func() error { _, err := spread.Reserve(ctx, "k", "a", 1); return err }},
		{"penalty", ratelimit.ErrInvalidOption, func() error { _, err := penalty.Settle(ctx, "k", "a", 1); return err }},
	} {
		err := c.f()
		require.ErrorIs(t, err, c.err, c.name)
		require.Equal(t, ratelimit.OutcomeNotConsumed, ratelimit.OutcomeOf(err), c.name)
	}
	// The largest actual saturates; it does not wrap.
	_, err := l.Reserve(ctx, "big", "a", 1)
	require.NoError(t, err)
	st, err := l.Settle(ctx, "big", "a", math.MaxInt64)
	require.NoError(t, err)
	require.EqualValues(t, math.MaxInt64-1, st.Charged)
	require.EqualValues(t, int64(math.MaxInt64), used(t, l, "big"))
}
