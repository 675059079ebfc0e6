package ratelimit_test

import (
	"context"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

func concurrencyLimiter(t *testing.T, name string, limit int64, lease time.Duration, opts ...ratelimit.DatabaseOptions) *ratelimit.Limiter {
	t.Helper()
	pool, _ := dbtest.Pool(t)
	return testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Algorithm: ratelimit.Concurrency, Limit: limit, Window: lease}, opts...)
}

// At most Limit slots are held; a release frees a place at once; releasing
// again, or a slot that was never granted, changes nothing.
func TestAcquireHoldsAtMostLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l := concurrencyLimiter(t, "slots", 3, time.Minute)
	var slots []*ratelimit.Slot
	for i := range 3 {
		s, d, err := l.Acquire(ctx, "tenant")
		require.NoError(t, err)
		require.True(t, d.Allowed, "acquire %d", i)
		require.NotNil(t, s)
		require.EqualValues(t, i+1, d.Used)
		require.EqualValues(t, 2-i, d.Remaining)
		require.EqualValues(t, 3, d.Limit)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		slots = append(slots, s)
	}
	s, d, err := l.Acquire(ctx, "tenant")
	require.NoError(t, err)
	require.Nil(t, s)
	require.False(t, d.Allowed)
	require.EqualValues(t, 3, d.Used)
	require.Greater(t, d.RetryAfter, 50*time.Second, "a place frees when the earliest lease lapses, at the latest")
	require.LessOrEqual(t, d.RetryAfter, time.Minute)

	// Another key has its own slots.
	other, d, err := l.Acquire(ctx, "other")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.NoError(t, other.Release(ctx))

	require.NoError(t, slots[1].Release(ctx))
	require.ErrorIs(t, slots[1].Err(), ratelimit.ErrSlotReleased)
	select {
	case <-slots[1].Done():
	default:
		t.Fatal("Done not closed by Release")
	}
	require.NoError(t, slots[1].Release(ctx), "releasing twice is harmless")
	p, err := l.Peek(ctx, "tenant")
	require.NoError(t, err)
	require.EqualValues(t, 2, p.Used)
	s, d, err = l.Acquire(ctx, "tenant")
	require.NoError(t, err)
	require.True(t, d.Allowed, "a release frees a place at once")
	require.NoError(t, s.Release(ctx))
	require.NoError(t, slots[0].Release(ctx))
	require.NoError(t, slots[2].Release(ctx))
	p, err = l.Peek(ctx, "tenant")
	require.NoError(t, err)
	require.EqualValues(t, 0, p.Used)
	require.True(t, p.Allowed)
}

// A slot its holder stops extending lapses after the lease, not before;
// one that is held is extended past it.
func TestSlotLeaseLapsesAndIsExtended(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := dbtest.Pool(t)
	// Long enough that an acquire or an extension on a busy machine (a
	// statement may then take a second) is answered within it.
	const lease = 3 * time.Second
	cfg := ratelimit.Config{Name: "lapse", Algorithm: ratelimit.Concurrency, Limit: 1, Window: lease}
	// A holder in another "process" (Database) that stops extending: its
	// pool is closed under it, as a killed process's connections are.
	deadPool := dbtest.PoolOn(t, schema)
	dying := testkit.NewLimiter(t, deadPool, cfg)
	l := testkit.NewLimiter(t, pool, cfg)

	held, d, err := l.Acquire(ctx, "kept")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	gone, d, err := dying.Acquire(ctx, "abandoned")
	require.NoError(t, err)
	require.True(t, d.Allowed, "%+v", d)
	start := time.Now()
	deadPool.Close()

	// The abandoned slot holds its place until its lease lapses.
	for time.Since(start) < lease*8/10 {
		_, d, err = l.Acquire(ctx, "abandoned")
		require.NoError(t, err)
		if time.Since(start) < lease*8/10 {
			require.False(t, d.Allowed, "taken %v after the holder stopped, within its lease", time.Since(start))
		}
		time.Sleep(50 * time.Millisecond)
	}
	var s *ratelimit.Slot
	require.Eventually(t, func() bool {
		s, d, err = l.Acquire(ctx, "abandoned")
		return err == nil && d.Allowed
	}, 2*lease, 20*time.Millisecond, "the abandoned slot lapses")
	require.NoError(t, s.Release(ctx))
	// Its holder learns it lost it.
	select {
	case <-gone.Done():
		require.ErrorIs(t, gone.Err(), ratelimit.ErrSlotLost)
	case <-time.After(5 * time.Second):
		t.Fatal("the abandoned slot was not reported lost")
	}

	// The kept slot, three leases later, is still held.
	time.Sleep(3*lease - time.Since(start))
	require.NoError(t, held.Err())
	_, d, err = l.Acquire(ctx, "kept")
	require.NoError(t, err)
	require.False(t, d.Allowed, "a held slot is extended past its lease")
	require.NoError(t, held.Release(ctx))
}

// Many goroutines of several Databases (as processes) at once never hold
// more than Limit.
func TestAcquireConcurrentNeverOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := dbtest.Pool(t)
	const limit = 3
	cfg := ratelimit.Config{Name: "race", Algorithm: ratelimit.Concurrency, Limit: limit, Window: 10 * time.Second}
	var limiters []*ratelimit.Limiter
	for range 3 {
		limiters = append(limiters, testkit.NewLimiter(t, dbtest.PoolOn(t, schema), cfg))
	}
	var inside, most, granted atomic.Int64
	var wg sync.WaitGroup
	for g := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := limiters[g%len(limiters)]
			for range 15 {
				s, d, err := l.Acquire(ctx, "k")
				if err != nil {
					t.Error(err)
					return
				}
				if !d.Allowed {
					continue
				}
				granted.Add(1)
				n := inside.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				time.Sleep(time.Millisecond)
				inside.Add(-1)
				if err := s.Release(ctx); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	require.LessOrEqual(t, most.Load(), int64(limit))
	require.Positive(t, granted.Load())
	p, err := limiters[0].Peek(ctx, "k")
	require.NoError(t, err)
	require.EqualValues(t, 0, p.Used, "every slot released")
}

// The counting verbs refuse a concurrency limit, and Acquire a rate limit;
// configurations a concurrency limit cannot honour are refused.
func TestConcurrencyRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	l := concurrencyLimiter(t, "refuse", 2, time.Second)
	_, err := l.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorContains(t, err, "Limiter.Acquire")
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	rate := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "rate", Limit: 1, Window: time.Second})
	_, _, err = rate.Acquire(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = testkit.New(conn.Conn(), ratelimit.Config{Name: "one-conn", Algorithm: ratelimit.Concurrency, Limit: 1, Window: time.Second})
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorContains(t, err, "*pgxpool.Pool")
	for _, c := range []struct {
		cfg  ratelimit.Config
		want error
	}{
		{ratelimit.Config{Window: 50 * time.Millisecond}, ratelimit.ErrInvalidWindow},
		{ratelimit.Config{Window: time.Second, Burst: 5}, ratelimit.ErrInvalidBurst},
		{ratelimit.Config{Window: time.Second, Penalty: true}, ratelimit.ErrInvalidOption},
		{ratelimit.Config{Window: time.Second, Spread: 2}, ratelimit.ErrInvalidOption},
		{ratelimit.Config{Window: time.Second, Policy: "api"}, ratelimit.ErrInvalidOption},
		{ratelimit.Config{Window: time.Second, KeyByWindow: true}, ratelimit.ErrInvalidOption},
	} {
		c.cfg.Name, c.cfg.Algorithm, c.cfg.Limit = "bad", ratelimit.Concurrency, 2
		_, err := testkit.New(pool, c.cfg)
		require.ErrorIs(t, err, c.want, "%+v", c.cfg)
	}
}

// AcquireTx takes the slot with the caller's transaction: a rollback gives
// it back.
func TestAcquireTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	l := concurrencyLimiter(t, "tx", 1, 3*time.Second)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	s, d, err := l.AcquireTx(ctx, tx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.NoError(t, tx.Rollback(ctx))
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.EqualValues(t, 0, p.Used, "rolled back with the transaction")
	select {
	case <-s.Done():
		require.ErrorIs(t, s.Err(), ratelimit.ErrSlotLost)
	case <-time.After(5 * time.Second):
		t.Fatal("a slot rolled back was not found lost at its first extension")
	}

	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		s, d, err = l.AcquireTx(ctx, tx, "k")
		return err
	}))
	require.True(t, d.Allowed)
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, s.ReleaseTx(ctx, tx))
	require.NoError(t, tx.Commit(ctx))
	p, err = l.Peek(ctx, "k")
	require.NoError(t, err)
	require.EqualValues(t, 0, p.Used)
}

// When PostgreSQL cannot answer, Acquire follows the failure policy: in
// memory under FailToMemory (Release gives the place back there), nowhere
// under FailOpen, refused under FailClosed, the error under FailError.
func TestAcquireFailurePolicies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dead := testkit.DeadPool(t)
	opts := ratelimit.DatabaseOptions{Timeout: 200 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}
	mk := func(p ratelimit.FailurePolicy) *ratelimit.Limiter {
		return testkit.NewLimiter(t, dead, ratelimit.Config{Name: "down", Algorithm: ratelimit.Concurrency, Limit: 2,
			Window: time.Second, OnFailure: p}, opts)
	}

	mem := mk(ratelimit.FailToMemory)
	a, d, err := mem.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StoreMemory, d.Store)
	b, d, err := mem.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	s, d, err := mem.Acquire(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed, "memory holds at most FallbackLimit")
	require.Nil(t, s)
	require.NoError(t, a.Release(ctx))
	require.NoError(t, a.Release(ctx))
	c, d, err := mem.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed, "a release gives the memory place back, once")
	_, d, err = mem.Acquire(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.NoError(t, b.Release(ctx))
	require.NoError(t, c.Release(ctx))

	open := mk(ratelimit.FailOpen)
	for range 3 {
		s, d, err := open.Acquire(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, ratelimit.StorePolicy, d.Store)
		require.NoError(t, s.Release(ctx))
	}
	_, d, err = mk(ratelimit.FailClosed).Acquire(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	_, _, err = mk(ratelimit.FailError).Acquire(ctx, "k")
	require.Error(t, err)
	require.False(t, ratelimit.IsConfigError(err), "%v", err)
}

// The Observer sees each acquire's decision, as it sees checks.
func TestAcquireObserved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	var o testkit.Observer
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "observed", Algorithm: ratelimit.Concurrency, Limit: 1, Window: time.Minute},
		ratelimit.DatabaseOptions{Observer: &o})
	s, _, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	_, _, err = l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, s.Release(ctx))
	decs := o.Decisions()
	require.Len(t, decs, 2)
	require.True(t, decs[0].Allowed)
	require.False(t, decs[1].Allowed)
	require.Equal(t, []string{"observed", "observed"}, o.Names())
}

// A MemoryLimiter holds slots of its process.
func TestMemoryAcquire(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m, err := ratelimit.NewMemory(ratelimit.Config{Name: "mem", Algorithm: ratelimit.Concurrency, Limit: 2, Window: time.Second}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	a, d, err := m.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StoreMemory, d.Store)
	b, _, err := m.Acquire(ctx, "k")
	require.NoError(t, err)
	s, d, err := m.Acquire(ctx, "k")
	require.NoError(t, err)
	require.Nil(t, s)
	require.False(t, d.Allowed)
	require.NoError(t, a.Release(ctx))
	require.NoError(t, a.Release(ctx))
	p, err := m.Peek(ctx, "k")
	require.NoError(t, err)
	require.EqualValues(t, 1, p.Used)
	require.NoError(t, b.Release(ctx))
	_, err = m.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	rate, err := ratelimit.NewMemory(ratelimit.Config{Name: "rate", Limit: 2, Window: time.Second}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	_, _, err = rate.Acquire(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
}

// A slot dropped without Release is released once the garbage collector
// finds it, with a warning: a forgotten Release does not hold a place for
// as long as the process lives.
func TestDroppedSlotIsReleased(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	var logs testkit.LogBuffer
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "leak", Algorithm: ratelimit.Concurrency, Limit: 1, Window: time.Minute},
		ratelimit.DatabaseOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	func() {
		_, d, err := l.Acquire(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
	}()
	require.Eventually(t, func() bool {
		runtime.GC()
		p, err := l.Peek(ctx, "k")
		return err == nil && p.Used == 0
	}, 10*time.Second, 50*time.Millisecond, "the dropped slot is released")
	require.Contains(t, logs.String(), "dropped without Release")
}

// An acquire answered after the lease it would grant had run out (it
// waited on the key's row longer than the Window) holds nothing: it is
// reported refused, and the place is freed.
func TestAcquireAnsweredTooLateIsNotHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	const lease = 300 * time.Millisecond
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "late", Algorithm: ratelimit.Concurrency, Limit: 2, Window: lease},
		ratelimit.DatabaseOptions{Timeout: 10 * time.Second})
	// A first acquire makes the key's row. On a busy machine it may itself
	// be answered after its short lease, and is then not held: try again.
	require.Eventually(t, func() bool {
		first, d, err := l.Acquire(ctx, "k")
		if err != nil || !d.Allowed {
			return false
		}
		return first.Release(ctx) == nil
	}, 10*time.Second, 10*time.Millisecond, "an acquire answered within its lease")
	// Lock the key's row for longer than the lease.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT 1 FROM pgrl_concurrency FOR UPDATE")
	require.NoError(t, err)
	go func() {
		time.Sleep(2 * lease)
		_ = tx.Rollback(ctx)
	}()
	s, d, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.Nil(t, s)
	require.False(t, d.Allowed)
	require.Contains(t, d.Reason, "lease")
	require.Eventually(t, func() bool {
		p, err := l.Peek(ctx, "k")
		return err == nil && p.Used == 0
	}, 5*time.Second, 20*time.Millisecond)
}

// TestReleaseOfALapsedSlotReportsItLost: a slot whose lease ran out in
// PostgreSQL before its holder noticed (the database's clock moved past
// it: a holder stalled longer than the margin looks the same) is released
// without error, and Err then says it was lost, not released.
func TestReleaseOfALapsedSlotReportsItLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testkit.NewClock(time.Now())
	l := concurrencyLimiter(t, "lapsed-release", 1, time.Minute, ratelimit.DatabaseOptions{Now: c.Now})
	s, d, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	c.Add(2 * time.Minute) // the database's clock only: no extension was made
	other, d, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed, "the lapsed slot's place is free")
	require.NoError(t, s.Release(ctx))
	require.ErrorIs(t, s.Err(), ratelimit.ErrSlotLost, "released after it had lapsed")
	require.NoError(t, other.Release(ctx))
	require.ErrorIs(t, other.Err(), ratelimit.ErrSlotReleased)
}
