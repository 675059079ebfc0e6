package ratelimit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
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
			limits := testkit.NewDatabase(t, db, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)}) // the limits of one AllowAll
			perIP := testkit.Limiter(t, limits, ratelimit.Config{Name: "ip", Limit: 2, Window: time.Minute, DenyCacheSize: -1})
			perEmail := testkit.Limiter(t, limits, ratelimit.Config{Name: "email", Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Minute})
			global := testkit.Limiter(t, limits, ratelimit.Config{Name: "global", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour})

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
	a := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "a", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	b := testkit.NewLimiter(t, other, ratelimit.Config{Name: "b", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})

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
		limits := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)}) // the limits of one AllowAll
		a := testkit.Limiter(t, limits, ratelimit.Config{Name: "same-a-" + string(alg), Algorithm: alg, Limit: 1, Window: time.Hour, DenyCacheSize: -1})
		b := testkit.Limiter(t, limits, ratelimit.Config{Name: "same-b-" + string(alg), Algorithm: alg, Limit: 2, Window: time.Hour, DenyCacheSize: -1})
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

// TestGroupsRideSharedStatements: all-or-nothing decisions of one
// algorithm made by many goroutines at once ride the coalescer's shared
// statements (fewer statements than decisions), and stay exact: every
// counter holds exactly the units its admitted decisions were granted, and
// a denied decision consumed nothing.
func TestGroupsRideSharedStatements(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(4))
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			db := &testkit.CountingDB{Pool: pool}
			clock := testkit.Pinned(time.Date(2031, 3, 4, 5, 6, 7, 0, time.UTC))
			var ls []*ratelimit.Limiter
			shared := testkit.NewDatabase(t, db, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, MaxInFlight: 1, Now: clock})
			for i, limit := range []int64{40, 25} {
				ls = append(ls, testkit.Limiter(t, shared, ratelimit.Config{Name: fmt.Sprintf("ride-%d", i), Algorithm: alg, Limit: limit, Window: time.Hour, DenyCacheSize: -1}))
			}
			require.True(t, ratelimit.SharesCoalescer(ls[0], ls[1]))
			type target struct{ lim, key int }
			var mu sync.Mutex
			granted := map[target]int64{}
			var decisions, denied int
			var wg sync.WaitGroup
			for w := range 8 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(w), 3))
					for range 40 {
						ts := []target{{0, rng.IntN(3)}, {1, rng.IntN(3)}}
						checks := make([]ratelimit.Check, len(ts))
						for i, tg := range ts {
							checks[i] = ratelimit.Check{Limiter: ls[tg.lim], Key: fmt.Sprintf("k%d", tg.key), Cost: 1 + rng.Int64N(2)}
						}
						m, err := ratelimit.AllowAll(context.Background(), ratelimit.AllOrNothing, checks...)
						if err != nil {
							t.Error(err)
							return
						}
						mu.Lock()
						decisions++
						if !m.Allowed {
							denied++
						}
						for i, d := range m.Decisions {
							if d.Store != ratelimit.StorePostgres {
								t.Errorf("decided by %s: %s", d.Store, d.Reason)
							}
							if !m.Allowed && d.Granted != 0 {
								t.Errorf("a denied decision granted %d", d.Granted)
							}
							granted[ts[i]] += d.Granted
						}
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			statements := db.Statements()
			t.Logf("%d decisions (%d denied) in %d statements", decisions, denied, statements)
			require.Positive(t, denied, "denials happened")
			require.Less(t, statements, int64(decisions), "decisions shared statements")
			for lim, l := range ls {
				for key := range 3 {
					d, err := l.Peek(context.Background(), fmt.Sprintf("k%d", key))
					require.NoError(t, err)
					require.Equal(t, granted[target{lim, key}], d.Used, "limiter %d key %d", lim, key)
				}
			}
		})
	}
}
