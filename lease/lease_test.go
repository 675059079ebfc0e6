package lease

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// base is the start of a minute on the pinned clocks of these tests.
var base = time.Date(2030, 1, 2, 3, 4, 0, 0, time.UTC)

// setup is a limiter of cfg on a fresh schema, its clock pinned to c (nil:
// the database's clock), and the pool.
func setup(t *testing.T, cfg ratelimit.Config, c *testkit.Clock) (*ratelimit.Limiter, ratelimit.DB) {
	t.Helper()
	pool, _ := dbtest.Pool(t)
	var o ratelimit.DatabaseOptions
	if c != nil {
		o.Now = c.Now
	}
	return testkit.NewLimiter(t, pool, cfg, o), pool
}

func newLease(t *testing.T, l *ratelimit.Limiter, opts Options) *Limiter {
	t.Helper()
	x, err := New(l, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close(context.Background()) })
	return x
}

func peekUsed(t *testing.T, l ratelimit.Checker, key string) int64 {
	t.Helper()
	d, err := l.Peek(context.Background(), key)
	require.NoError(t, err)
	return d.Used
}

func TestLeaseOptionsValidated(t *testing.T) {
	t.Parallel()
	l, _ := setup(t, ratelimit.Config{Name: "opts", Limit: 100, Window: time.Minute}, nil)

	_, err := New(nil, Options{Eager: true, Size: 1})
	require.ErrorIs(t, err, ErrNilLimiter)

	for _, size := range []int64{0, -1, math.MinInt64, 101, math.MaxInt64} {
		_, err := New(l, Options{Eager: true, Size: size})
		require.ErrorIs(t, err, ErrInvalidSize, "size %d", size)
		require.Contains(t, err.Error(), "set Options.Size between 1 and the limit 100")
	}
	for _, share := range []int{-1, math.MinInt} {
		_, err := New(l, Options{Eager: true, Size: 10, Share: share})
		require.ErrorIs(t, err, ErrInvalidShare, "share %d", share)
		require.Contains(t, err.Error(), "use 1 or more")
	}
	for _, idle := range []time.Duration{-1, time.Nanosecond, MinIdle - 1, math.MinInt64} {
		_, err := New(l, Options{Eager: true, Size: 10, Idle: idle})
		require.ErrorIs(t, err, ErrInvalidIdle, "idle %v", idle)
		require.Contains(t, err.Error(), "use at least 1ms")
	}
	_, err = New(l, Options{Eager: true, Size: 10, DB: (*pgxpool.Pool)(nil)})
	require.ErrorIs(t, err, ErrInvalidDB)
	require.Contains(t, err.Error(), "or leave DB nil")
	// The extremes that are valid.
	for _, o := range []Options{
		{Size: 1}, {Size: 100}, {Size: 10, Share: math.MaxInt}, {Size: 10, Idle: math.MaxInt64}, {Size: 10, Idle: MinIdle},
	} {
		x, err := New(l, o)
		require.NoError(t, err, "%+v", o)
		require.NoError(t, x.Close(context.Background()))
	}
	x := newLease(t, l, Options{Eager: true, Size: 10})
	require.Equal(t, DefaultShare, x.opts.Share)
	require.Equal(t, DefaultIdle, x.opts.Idle)
	require.Equal(t, l.Config(), x.Config())
}

func TestLeaseRefusesWhatItCannotLease(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	d := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{})
	for _, c := range []struct {
		cfg  ratelimit.Config
		want string
	}{
		{ratelimit.Config{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Minute, Penalty: true}, "token bucket with Penalty"},
		{ratelimit.Config{Name: "spread", Limit: 10, Window: time.Minute, Spread: 2}, "Spread 2"},
		{ratelimit.Config{Name: "pol", Limit: 10, Window: time.Minute, Policy: "p"}, "stored policy"},
	} {
		_, err := New(testkit.Limiter(t, d, c.cfg), Options{Eager: true, Size: 1})
		require.ErrorIs(t, err, ErrUnsupported, c.cfg.Name)
		require.Contains(t, err.Error(), c.want)
	}

	x := newLease(t, testkit.Limiter(t, d, ratelimit.Config{Name: "ok", Limit: 10, Window: time.Minute}), Options{Eager: true, Size: 5})
	ctx := context.Background()
	at := ratelimit.AtRate(ratelimit.Rate{Limit: 5, Window: time.Second})
	_, err := x.Allow(ctx, "k", at)
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.Contains(t, err.Error(), "lease one limiter per rate")
	_, err = x.Peek(ctx, "k", at)
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorIs(t, x.Reset(ctx, "k", at), ratelimit.ErrInvalidOption)
	_, err = x.Peek(ctx, "k", ratelimit.Cost(1))
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	_, err = x.Allow(ctx, "k", ratelimit.Option{})
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	_, err = x.Allow(ctx, "k", ratelimit.Cost(1), ratelimit.UpTo(2))
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	for _, o := range []ratelimit.Option{ratelimit.Cost(0), ratelimit.Cost(-1), ratelimit.UpTo(0), ratelimit.UpTo(math.MinInt64)} {
		_, err = x.Allow(ctx, "k", o)
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	}
	_, err = x.Allow(ctx, "k", ratelimit.Cost(11))
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
	// None of these counted anything.
	require.Zero(t, peekUsed(t, x, "k"))
	require.Equal(t, Stats{}, x.Stats())
}

func TestLeaseAnswersFromTheSlice(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, _ := setup(t, ratelimit.Config{Name: "local", Limit: 100, Window: time.Minute}, c)
	x := newLease(t, l, Options{Eager: true, Size: 10, Now: c.Now})
	ctx := context.Background()

	d, err := x.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(1), d.Granted)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(1), d.Used)
	require.Equal(t, int64(99), d.Remaining)
	require.Equal(t, int64(10), peekUsed(t, l, "k"), "the slice is counted in PostgreSQL")

	for i := 2; i <= 10; i++ {
		c.Add(time.Second)
		d, err := x.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, int64(1), d.Granted)
		require.Equal(t, ratelimit.StoreLease, d.Store, "check %d", i)
		require.Equal(t, int64(i), d.Used)
		require.Equal(t, int64(100-i), d.Remaining)
		require.Equal(t, base.Add(time.Minute), d.ResetAt.UTC())
		require.Equal(t, base.Add(time.Duration(9+i)*time.Second), d.Now.UTC(), "Now follows the database's clock")
		require.Equal(t, d.ResetAt.Sub(d.Now), d.ResetAfter())
	}
	require.Equal(t, int64(10), peekUsed(t, l, "k"))
	require.Equal(t, Stats{Slices: 1, Leased: 10, UsedLocally: 10, LocalDecisions: 9, DatabaseDecisions: 1}, x.Stats())

	// UpTo from the slice: the next slice's ask is ceil(90/8) = 12, at most Size.
	d, err = x.Allow(ctx, "k", ratelimit.UpTo(4))
	require.NoError(t, err)
	require.Equal(t, int64(4), d.Granted)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(20), peekUsed(t, l, "k"))
	d, err = x.Allow(ctx, "k", ratelimit.Cost(6))
	require.NoError(t, err)
	require.Equal(t, int64(6), d.Granted)
	require.Equal(t, ratelimit.StoreLease, d.Store)
	require.Equal(t, int64(80), d.Remaining, "80 left in the database, none in the slice")
}

// TestLeaseSlicesShrinkNearTheLimit: with Share 4 each slice asks a quarter
// of what this process last saw remaining, and the last units go one by one.
func TestLeaseSlicesShrinkNearTheLimit(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, _ := setup(t, ratelimit.Config{Name: "share", Limit: 100, Window: time.Minute}, c)
	x := newLease(t, l, Options{Eager: true, Size: 50, Share: 4, Now: c.Now})
	ctx := context.Background()

	var counted []int64
	admitted := int64(0)
	for {
		before := x.Stats().Slices
		d, err := x.Allow(ctx, "k")
		require.NoError(t, err)
		if !d.Allowed {
			break
		}
		admitted++
		if x.Stats().Slices > before {
			counted = append(counted, peekUsed(t, l, "k"))
		}
	}
	require.Equal(t, int64(100), admitted, "one process alone uses every unit")
	// The statement sizes each slice from what is left: ceil(100/4)=25,
	// ceil(75/4)=19, 14, 11, 8, 6, 5, 3, 3, 2, 1, 1, 1, 1 (at most Size).
	require.Equal(t, []int64{25, 44, 58, 69, 77, 83, 88, 91, 94, 96, 97, 98, 99, 100}, counted)
	require.Equal(t, int64(100), x.Stats().Leased)
}

// Under Penalty a leased limit counts what the plain limit counts for the
// same checks, and admits the same: every attempt is charged its whole
// cost (a denied check's statement counts what the held units do not
// cover, and the held units pay the rest).
func TestLeasePenaltyCountsEveryAttempt(t *testing.T) {
	t.Parallel()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow} {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			c := testkit.NewClock(base.Add(10 * time.Second))
			cfg := ratelimit.Config{Algorithm: alg, Limit: 10, Window: time.Minute, Penalty: true, DenyCacheSize: -1}
			cfg.Name = "pen-plain"
			plain, _ := setup(t, cfg, c)
			cfg.Name = "pen-lease"
			leased, _ := setup(t, cfg, c)
			x := newLease(t, leased, Options{Eager: true, Size: 4, Share: 1, Now: c.Now})
			ctx := context.Background()
			var got, want []bool
			for _, cost := range []int64{3, 3, 3, 3, 1, 2} {
				d, err := plain.Allow(ctx, "k", ratelimit.Cost(cost))
				require.NoError(t, err)
				want = append(want, d.Allowed)
				d, err = x.Allow(ctx, "k", ratelimit.Cost(cost))
				require.NoError(t, err)
				got = append(got, d.Allowed)
			}
			require.Equal(t, []bool{true, true, true, false, false, false}, want)
			require.Equal(t, want, got)
			require.Equal(t, peekUsed(t, plain, "k"), peekUsed(t, leased, "k"), "every attempt charged its cost")
			require.Equal(t, int64(15), peekUsed(t, leased, "k"))
		})
	}
}

func TestLeaseDenialTakesNothing(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, _ := setup(t, ratelimit.Config{Name: "deny", Limit: 10, Window: time.Minute}, c)
	x := newLease(t, l, Options{Eager: true, Size: 4, Now: c.Now})
	ctx := context.Background()
	// Another process takes 7.
	d, err := l.Allow(ctx, "k", ratelimit.Cost(7))
	require.NoError(t, err)
	require.True(t, d.Allowed)

	d, err = x.Allow(ctx, "k", ratelimit.Cost(4))
	require.NoError(t, err)
	require.False(t, d.Allowed, "only 3 were left")
	require.Zero(t, d.Granted)
	require.Equal(t, int64(3), d.Remaining)
	require.Positive(t, d.RetryAfter)
	require.Equal(t, int64(7), peekUsed(t, l, "k"), "a slice that cannot cover the check takes nothing")
	require.Zero(t, x.Stats().Leased)
	// The last 3 units go one slice at a time (ceil(3/8) = 1).
	for range 3 {
		d, err = x.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, int64(1), d.Granted)
	}
	require.Equal(t, int64(3), x.Stats().Slices)
	d, err = x.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, int64(10), peekUsed(t, l, "k"))
}

func TestLeaseExpiresAtTheWindowEnd(t *testing.T) {
	t.Parallel()
	for _, a := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow} {
		t.Run(string(a), func(t *testing.T) {
			t.Parallel()
			c := testkit.NewClock(base.Add(50 * time.Second))
			l, _ := setup(t, ratelimit.Config{Name: "exp", Algorithm: a, Limit: 100, Window: time.Minute}, c)
			x := newLease(t, l, Options{Eager: true, Size: 10, Now: c.Now, Idle: time.Hour})
			ctx := context.Background()

			d, err := x.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, ratelimit.StorePostgres, d.Store)
			c.Set(base.Add(time.Minute - time.Microsecond))
			d, err = x.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, ratelimit.StoreLease, d.Store, "the last instant of the window")
			c.Set(base.Add(time.Minute))
			d, err = x.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, ratelimit.StorePostgres, d.Store, "the next window takes a new slice")
			require.Equal(t, int64(8), x.Stats().Dropped, "the first slice's unused units")
			require.Equal(t, int64(2), x.Stats().Slices)
		})
	}
}

func TestLeaseCloseReturnsUnits(t *testing.T) {
	t.Parallel()
	l, pool := setup(t, ratelimit.Config{Name: "close", Limit: 1000, Window: time.Hour}, nil)
	x, err := New(l, Options{Eager: true, Size: 100, DB: pool, Idle: time.Hour})
	require.NoError(t, err)
	ctx := context.Background()
	for _, k := range []string{"a", "b"} {
		for range 3 {
			d, err := x.Allow(ctx, k)
			require.NoError(t, err)
			require.True(t, d.Allowed)
		}
		require.Equal(t, int64(100), peekUsed(t, l, k))
	}
	require.NoError(t, x.Close(ctx))
	require.Equal(t, int64(3), peekUsed(t, l, "a"))
	require.Equal(t, int64(3), peekUsed(t, l, "b"))
	s := x.Stats()
	require.Equal(t, int64(194), s.Returned)
	require.Equal(t, s.Leased, s.UsedLocally+s.Returned+s.Dropped)
	_, err = x.Allow(ctx, "a")
	require.ErrorIs(t, err, ErrClosed)
	require.Contains(t, err.Error(), "make a new one with lease.New")
	require.ErrorIs(t, x.Reset(ctx, "a"), ErrClosed)
	require.NoError(t, x.Close(ctx), "a second Close")
}

// The sliding window's unused units go back to the window they were
// counted in: its count while the row is in it, its previous count once
// the row has moved one window on (where they weigh on the estimate).
func TestLeaseSlidingWindowUnitsAreReturned(t *testing.T) {
	t.Parallel()
	db := testkit.NewClock(base.Add(50 * time.Second))
	local := testkit.NewClock(base.Add(50 * time.Second))
	l, pool := setup(t, ratelimit.Config{Name: "sw", Algorithm: ratelimit.SlidingWindow, Limit: 1000, Window: time.Minute}, db)
	ctx := context.Background()
	row := func(key string) (cur, prev int64) {
		t.Helper()
		k := ratelimit.StoredKey(ratelimit.HashedKeys, "sw", key)
		require.NoError(t, pool.QueryRow(ctx, "SELECT count, prev_count FROM pgrl_sliding_window WHERE key = $1", k).Scan(&cur, &prev))
		return cur, prev
	}

	x, err := New(l, Options{Eager: true, Size: 100, DB: pool, Now: local.Now, Idle: time.Hour})
	require.NoError(t, err)
	_, err = x.Allow(ctx, "same")
	require.NoError(t, err)
	require.NoError(t, x.Close(ctx))
	cur, prev := row("same")
	require.Equal(t, [2]int64{1, 0}, [2]int64{cur, prev}, "back into the window's count")
	require.Equal(t, Stats{Slices: 1, Leased: 100, UsedLocally: 1, Returned: 99, DatabaseDecisions: 1}, x.Stats())

	// The database's clock is already in the next window, where another
	// process checks: the units go to the previous count.
	x, err = New(l, Options{Eager: true, Size: 100, DB: pool, Now: local.Now, Idle: time.Hour})
	require.NoError(t, err)
	_, err = x.Allow(ctx, "next")
	require.NoError(t, err)
	db.Set(base.Add(70 * time.Second))
	_, err = l.Allow(ctx, "next", ratelimit.Cost(5))
	require.NoError(t, err)
	require.NoError(t, x.Close(ctx))
	cur, prev = row("next")
	require.Equal(t, [2]int64{5, 1}, [2]int64{cur, prev}, "the next window keeps its count; the previous one gets the units back")

	// Two windows on, the row has forgotten them: nothing changes.
	db.Set(base.Add(50 * time.Second))
	x, err = New(l, Options{Eager: true, Size: 100, DB: pool, Now: local.Now, Idle: time.Hour})
	require.NoError(t, err)
	_, err = x.Allow(ctx, "far")
	require.NoError(t, err)
	db.Set(base.Add(130 * time.Second))
	_, err = l.Allow(ctx, "far", ratelimit.Cost(5))
	require.NoError(t, err)
	require.NoError(t, x.Close(ctx))
	cur, prev = row("far")
	require.Equal(t, [2]int64{5, 0}, [2]int64{cur, prev})
	require.Equal(t, int64(99), x.Stats().Dropped)
}

func TestLeaseIdleSliceReturned(t *testing.T) {
	t.Parallel()
	t.Run("background", func(t *testing.T) {
		t.Parallel()
		l, pool := setup(t, ratelimit.Config{Name: "idlebg", Limit: 100_000, Window: time.Hour}, nil)
		x, err := New(l, Options{Eager: true, Size: 10, DB: pool, Idle: 20 * time.Millisecond})
		require.NoError(t, err)
		swept := make(chan struct{}, 1)
		f := func() {
			select {
			case swept <- struct{}{}:
			default:
			}
		}
		x.afterSweep.Store(&f)
		t.Cleanup(func() { _ = x.Close(context.Background()) })
		ctx := context.Background()
		d, err := x.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		deadline := time.After(30 * time.Second)
		for x.Stats().Returned == 0 {
			select {
			case <-swept:
			case <-deadline:
				t.Fatal("the idle slice was not returned within 30s")
			}
		}
		require.Equal(t, int64(9), x.Stats().Returned)
		require.Equal(t, int64(1), peekUsed(t, l, "k"))
	})
}

func TestLeaseSweepReturnsOnlyIdleKeys(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, pool := setup(t, ratelimit.Config{Name: "sweep", Limit: 100, Window: time.Minute}, c)
	x := newLease(t, l, Options{Eager: true, Size: 10, DB: pool, Now: c.Now, Idle: 5 * time.Second})
	ctx := context.Background()
	_, err := x.Allow(ctx, "old")
	require.NoError(t, err)
	c.Add(3 * time.Second)
	_, err = x.Allow(ctx, "new")
	require.NoError(t, err)
	c.Add(2 * time.Second)
	x.sweep(ctx)
	require.Equal(t, int64(1), peekUsed(t, l, "old"), "idle for 5s: returned")
	require.Equal(t, int64(10), peekUsed(t, l, "new"), "idle for 2s: kept")
	require.Equal(t, int64(9), x.Stats().Returned)
	// The returned key starts afresh: a new slice of Size.
	d, err := x.Allow(ctx, "old")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(11), peekUsed(t, l, "old"))
}

func TestLeaseResetDropsTheSlice(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, pool := setup(t, ratelimit.Config{Name: "reset", Limit: 100, Window: time.Minute}, c)
	x := newLease(t, l, Options{Eager: true, Size: 10, DB: pool, Now: c.Now, Idle: time.Hour})
	ctx := context.Background()
	_, err := x.Allow(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, x.Reset(ctx, "k"))
	require.Zero(t, peekUsed(t, l, "k"))
	d, err := x.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store, "the slice was dropped")

	// Another process resets the key while this one holds 9 units: they
	// are given back without taking the count below zero.
	require.NoError(t, l.Reset(ctx, "k"))
	require.NoError(t, x.Close(ctx))
	require.Zero(t, peekUsed(t, l, "k"))
	d, err = l.Allow(ctx, "k", ratelimit.UpTo(math.MaxInt64))
	require.NoError(t, err)
	require.Equal(t, int64(100), d.Granted, "exactly the limit after the reset")
}

// TestLeaseConcurrentChecksExact: 64 goroutines of one process on one key
// admit exactly the limit: every leased unit is used by a check.
func TestLeaseConcurrentChecksExact(t *testing.T) {
	t.Parallel()
	for _, a := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow} {
		t.Run(string(a), func(t *testing.T) {
			t.Parallel()
			l, _ := setup(t, ratelimit.Config{Name: "conc", Algorithm: a, Limit: 1000, Window: time.Hour}, nil)
			x := newLease(t, l, Options{Eager: true, Size: 50, Idle: time.Hour})
			var admitted atomic.Int64
			var wg sync.WaitGroup
			for range 64 {
				wg.Go(func() {
					for {
						d, err := x.Allow(context.Background(), "hot", ratelimit.Cost(1))
						if err != nil {
							t.Error(err)
							return
						}
						if !d.Allowed {
							return
						}
						admitted.Add(d.Granted)
					}
				})
			}
			wg.Wait()
			require.Equal(t, int64(1000), admitted.Load())
			require.Equal(t, int64(1000), peekUsed(t, l, "hot"))
			s := x.Stats()
			require.Equal(t, int64(1000), s.UsedLocally)
			require.Less(t, s.Slices, int64(100))
		})
	}
}

// TestLeaseWritesPerCheck: on a hot key (10,000 per minute, 64 goroutines)
// the statements sent are at most 1 in 50 admitted checks.
func TestLeaseWritesPerCheck(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	db := &testkit.CountingDB{Pool: pool}
	c := testkit.NewClock(base.Add(time.Second))
	l := testkit.NewLimiter(t, db, ratelimit.Config{Name: "writes", Limit: 10_000, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	x := newLease(t, l, Options{Size: 500, Now: c.Now, Idle: time.Hour})
	var admitted, checks atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for {
				d, err := x.Allow(context.Background(), "hot")
				if err != nil {
					t.Error(err)
					return
				}
				checks.Add(1)
				if !d.Allowed {
					return
				}
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	n := db.Statements()
	t.Logf("%d statements for %d admitted checks (%d checks): 1 in %.0f", n, admitted.Load(), checks.Load(), float64(admitted.Load())/float64(n))
	require.Equal(t, int64(10_000), admitted.Load())
	require.LessOrEqual(t, n*50, admitted.Load())
}

func TestLeasePassesThroughTheFailurePolicy(t *testing.T) {
	t.Parallel()
	l := testkit.NewLimiter(t, testkit.DeadPool(t), ratelimit.Config{Name: "dead", Limit: 100, Window: time.Minute, OnFailure: ratelimit.FailOpen}, ratelimit.DatabaseOptions{Timeout: time.Second})
	x := newLease(t, l, Options{Eager: true, Size: 10})
	ctx := context.Background()
	for range 3 {
		d, err := x.Allow(ctx, "k", ratelimit.Cost(2))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, ratelimit.StorePolicy, d.Store)
		require.Equal(t, int64(2), d.Granted, "the check's cost, not the slice's ask")
	}
	// The failure policy answers a slice as a check of its min: for an
	// UpTo check, one unit.
	d, err := x.Allow(ctx, "k", ratelimit.UpTo(3))
	require.NoError(t, err)
	require.Equal(t, int64(1), d.Granted)
	require.Zero(t, x.Stats().Slices)
	require.Zero(t, x.Stats().LocalDecisions)
	require.Zero(t, x.Stats().DatabaseDecisions)
	require.Equal(t, int64(4), x.Stats().OtherDecisions)
	require.NoError(t, x.Close(ctx))
}

// TestLeaseReturnLandsInItsWindow: units are returned to the window they
// were counted in, even when the database's clock is already in the next
// window (the local clock lags): the next window's count is untouched.
func TestLeaseReturnLandsInItsWindow(t *testing.T) {
	t.Parallel()
	db := testkit.NewClock(base.Add(50 * time.Second))
	local := testkit.NewClock(base.Add(50 * time.Second))
	l, pool := setup(t, ratelimit.Config{Name: "pin", Limit: 100, Window: time.Minute}, db)
	x, err := New(l, Options{Eager: true, Size: 10, DB: pool, Now: local.Now, Idle: time.Hour})
	require.NoError(t, err)
	ctx := context.Background()
	_, err = x.Allow(ctx, "k")
	require.NoError(t, err)
	db.Set(base.Add(70 * time.Second))
	d, err := l.Allow(ctx, "k", ratelimit.Cost(5))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.NoError(t, x.Close(ctx))
	require.Equal(t, int64(9), x.Stats().Returned)
	require.Equal(t, int64(5), peekUsed(t, l, "k"), "the next window keeps its count")
	db.Set(base.Add(59 * time.Second))
	require.Equal(t, int64(1), peekUsed(t, l, "k"), "the lease's window got its units back")
}

// TestLeaseReturnsUnderLoad: goroutines check keys in bursts, so that keys
// go idle and their slices are returned by the background sweep while other
// keys are checked, then Close returns the rest. Afterwards every key's
// count in PostgreSQL is exactly what its checks admitted, and every leased
// unit is accounted for.
func TestLeaseReturnsUnderLoad(t *testing.T) {
	t.Parallel()
	l, pool := setup(t, ratelimit.Config{Name: "load", Limit: 1_000_000, Window: time.Hour}, nil)
	x, err := New(l, Options{Eager: true, Size: 100, DB: pool, Idle: MinIdle})
	require.NoError(t, err)
	ctx := context.Background()
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	admitted := make([]atomic.Int64, len(keys))
	deadline := time.Now().Add(300 * time.Millisecond)
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := g; time.Now().Before(deadline); i++ {
				k := i % len(keys)
				for range 1 + i%37 {
					d, err := x.Allow(ctx, keys[k], ratelimit.Cost(int64(1+i%3)))
					if err != nil {
						t.Error(err)
						return
					}
					if !d.Allowed {
						t.Errorf("denied under a limit of a million: %+v", d)
						return
					}
					admitted[k].Add(d.Granted)
				}
				if i%5 == 0 {
					time.Sleep(2 * time.Millisecond) // let keys go idle
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, x.Close(ctx))
	var total int64
	for k, key := range keys {
		require.Equal(t, admitted[k].Load(), peekUsed(t, l, key), "key %s", key)
		total += admitted[k].Load()
	}
	s := x.Stats()
	t.Logf("%+v", s)
	require.Equal(t, total, s.UsedLocally)
	require.Equal(t, s.Leased, s.UsedLocally+s.Returned)
	require.Zero(t, s.Dropped)
	require.Positive(t, s.Returned)
}

// By default a key's first check, and its first after it went idle, is the
// caller's own check (coalesced as without a lease); its next check within
// Idle takes a slice. A key checked once holds nothing.
func TestLeaseStartsAtTheSecondCheck(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	l, pool := setup(t, ratelimit.Config{Name: "lazy", Limit: 100, Window: time.Minute}, c)
	x := newLease(t, l, Options{Size: 10, DB: pool, Now: c.Now, Idle: 5 * time.Second})
	ctx := context.Background()

	d, err := x.Allow(ctx, "once", ratelimit.Cost(2))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(2), d.Granted)
	require.Equal(t, int64(2), peekUsed(t, l, "once"), "the check itself, no slice")
	require.Zero(t, x.Stats().Slices)

	d, err = x.Allow(ctx, "once")
	require.NoError(t, err)
	require.Equal(t, int64(1), x.Stats().Slices, "the second check takes a slice")
	require.Equal(t, int64(12), peekUsed(t, l, "once"))
	d, err = x.Allow(ctx, "once")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreLease, d.Store)

	// Idle for longer than Idle: the next check is the caller's own again
	// (the slice, not swept here, is used first while it lasts).
	c.Add(6 * time.Second)
	x.sweep(ctx)
	require.Equal(t, int64(4), peekUsed(t, l, "once"), "the idle slice went back")
	d, err = x.Allow(ctx, "once")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(5), peekUsed(t, l, "once"))
	require.Equal(t, int64(1), x.Stats().Slices)
	require.Equal(t, Stats{Slices: 1, Leased: 10, UsedLocally: 2, Returned: 8, LocalDecisions: 1, DatabaseDecisions: 3}, x.Stats())
}

// A token bucket's slices: never more than the bucket admits without a
// lease (a slow refill, so the burst is what there is), the units out on
// lease counted against the capacity while the bucket refills, unused
// units returned at Close, and a slice ending TokenBucketLeaseTime after it
// was taken.
func TestLeaseTokenBucket(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("never over", func(t *testing.T) {
		t.Parallel()
		c := testkit.NewClock(base.Add(10 * time.Second))
		l, pool := setup(t, ratelimit.Config{Name: "tb-over", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour}, c)
		x := newLease(t, l, Options{Size: 10, DB: pool, Now: c.Now, Idle: time.Hour})
		admitted := 0
		for range 300 {
			d, err := x.Allow(ctx, "k")
			require.NoError(t, err)
			if d.Allowed {
				admitted++
			}
		}
		require.Equal(t, 100, admitted, "the burst, and nothing more")
		require.Positive(t, x.Stats().LocalDecisions)
	})
	t.Run("leased units count against the capacity", func(t *testing.T) {
		t.Parallel()
		c := testkit.NewClock(base.Add(10 * time.Second))
		// Refills 10 a second, burst 20.
		l, pool := setup(t, ratelimit.Config{Name: "tb-cap", Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: 20, Window: time.Second}, c)
		x := newLease(t, l, Options{Eager: true, Size: 10, Share: 1, DB: pool, Now: c.Now, Idle: time.Hour})
		d, err := x.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, int64(1), x.Stats().Slices)
		// 10 out on lease (9 unused); another process empties the rest.
		n := 0
		for {
			d, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if !d.Allowed {
				break
			}
			n++
		}
		require.Equal(t, 10, n)
		// 1.5 s later 15 have refilled, but the bucket holds only 10: the
		// capacity less the 10 still out on lease (the lease was taken in
		// the previous epoch of TokenBucketLeaseTime, which still counts).
		// Without that, 15 tokens and the lease's 9 unused units could be
		// taken at once: 24, more than the burst of 20.
		c.Add(1500 * time.Millisecond)
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(10), p.Remaining)
		// Once the lease is over, the bucket refills to its capacity.
		c.Add(time.Second)
		p, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(20), p.Remaining)
	})
	t.Run("returned and expired", func(t *testing.T) {
		t.Parallel()
		c := testkit.NewClock(base.Add(10 * time.Second))
		l, pool := setup(t, ratelimit.Config{Name: "tb-back", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour}, c)
		x, err := New(l, Options{Eager: true, Size: 10, Share: 1, DB: pool, Now: c.Now, Idle: time.Hour})
		require.NoError(t, err)
		_, err = x.Allow(ctx, "k")
		require.NoError(t, err)
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(90), p.Remaining)
		require.NoError(t, x.Close(ctx))
		require.Equal(t, int64(9), x.Stats().Returned)
		p, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(99), p.Remaining, "the unused units are tokens again")

		y := newLease(t, l, Options{Eager: true, Size: 10, Share: 1, DB: pool, Now: c.Now, Idle: time.Hour})
		d, err := y.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		c.Add(ratelimit.TokenBucketLeaseTime - time.Microsecond)
		d, err = y.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StoreLease, d.Store)
		c.Add(time.Microsecond)
		d, err = y.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store, "the slice ended with its lease time")
		require.Equal(t, int64(8), y.Stats().Dropped)
	})
}
