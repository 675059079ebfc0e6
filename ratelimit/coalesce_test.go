package ratelimit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

type observed struct {
	key     string
	cost    int64
	allowed bool
	before  int64 // units counted before this check, derived from Remaining
}

// TestCoalescedMatchesSequentialReplay fires 64 goroutines over 50 keys with
// costs 1–5 through a coalescing limiter, then replays the same checks one
// by one, without coalescing, in an order consistent with what each
// decision saw, on a fresh schema: every decision and every final count
// must be identical.
func TestCoalescedMatchesSequentialReplay(t *testing.T) {
	t.Parallel()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(8))
			ctx := context.Background()
			at := base.Add(30 * time.Second) // pinned: no refill, no window change
			// A long Timeout: on a busy machine no check may be answered by
			// the memory fallback, which the replay would not match.
			cfg := ratelimit.Config{Name: "coalesce", Algorithm: alg, Limit: 40, Window: time.Hour,
				DenyCacheSize: -1}
			clock := func() time.Time { return at }
			l := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: clock})

			var mu sync.Mutex
			var got []observed
			var wg sync.WaitGroup
			for g := range 64 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 1))
					for range 40 {
						key := fmt.Sprintf("k%02d", rng.IntN(50))
						cost := 1 + rng.Int64N(5)
						d, err := l.Allow(ctx, key, ratelimit.Cost(cost))
						if err != nil {
							t.Error(err)
							return
						}
						after := cfg.Limit - d.Remaining
						before := after
						if d.Allowed {
							before -= cost
						}
						mu.Lock()
						got = append(got, observed{key, cost, d.Allowed, before})
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			require.Len(t, got, 64*40)
			batched := ratelimit.BatchedChecks(l)
			t.Logf("%s: %d of %d checks rode coalesced statements", alg, batched, len(got))
			require.Positive(t, batched, "64 concurrent callers must coalesce")

			// Replay: per key, in the order of the count each check saw;
			// at one count, denials first (they change nothing).
			slices.SortStableFunc(got, func(a, b observed) int {
				if a.key != b.key {
					return compare(a.key, b.key)
				}
				if a.before != b.before {
					return int(a.before - b.before)
				}
				return boolRank(a.allowed) - boolRank(b.allowed)
			})
			replayPool, _ := dbtest.Pool(t)
			r := testkit.NewLimiter(t, replayPool, cfg, ratelimit.DatabaseOptions{Timeout: time.Minute, DisableCoalescing: true, Now: clock})
			admitted := map[string]int64{}
			for i, o := range got {
				d, err := r.Allow(ctx, o.key, ratelimit.Cost(o.cost))
				require.NoError(t, err)
				require.Equal(t, o.allowed, d.Allowed, "replay step %d: %+v", i, o)
				if d.Allowed {
					admitted[o.key] += o.cost
				}
			}
			for key, n := range admitted {
				a, err := l.Peek(ctx, key)
				require.NoError(t, err)
				b, err := r.Peek(ctx, key)
				require.NoError(t, err)
				require.Equal(t, b.Remaining, a.Remaining, "key %s", key)
				require.Equal(t, cfg.Limit-n, a.Remaining, "key %s", key)
			}
		})
	}
}

func compare(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func boolRank(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestCoalescingCancellation checks that a check waiting to be coalesced
// returns as soon as its context ends, and that checks of other keys do not
// queue behind a round trip stuck on a row lock.
func TestCoalescingCancellation(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(4))
	ctx := context.Background()
	// A token bucket: one row per key, so no window boundary can move the
	// checks of "busy" off the locked row.
	// Timeout: the first check must stay blocked on the row lock for as
	// long as the test looks (by default it would give up after 500ms).
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "cancel", Algorithm: ratelimit.TokenBucket, Limit: 1000, Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{MaxInFlight: 1, Timeout: time.Minute})

	// Hold the row lock of key "busy" so that the round trip in flight
	// waits, and the next checks queue behind it. The first check opens a
	// connection: how long it takes is the baseline for the bounds below
	// (1 s, or more on a machine measured slower).
	start := time.Now()
	_, err := l.Allow(ctx, "busy")
	require.NoError(t, err)
	bound := max(time.Second, 10*time.Since(start))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT 1 FROM pgrl_token_bucket FOR UPDATE")
	require.NoError(t, err)
	var holder int32
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&holder))

	first := make(chan error, 1)
	go func() {
		_, err := l.Allow(ctx, "busy")
		first <- err
	}()
	// Wait until the first check is in flight, blocked on the row lock.
	blocked := false
	for deadline := time.Now().Add(30 * time.Second); !blocked && time.Now().Before(deadline); {
		require.NoError(t, pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)))", holder).Scan(&blocked))
		time.Sleep(10 * time.Millisecond)
	}
	require.True(t, blocked, "the first check waits on the row lock")

	// A check of another key does not queue behind the stuck round trip
	// for long: it goes out alone and is answered.
	start = time.Now()
	d, err := l.Allow(ctx, "other")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Less(t, time.Since(start), bound)

	// A check of the locked key honours its context.
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	start = time.Now()
	d, err = l.Allow(cctx, "busy")
	require.ErrorIs(t, err, context.DeadlineExceeded, "decision %+v", d)
	require.Less(t, time.Since(start), bound, "a queued check honours its context")

	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, <-first)
	// The queue drains: later checks are answered.
	d, err = l.Allow(ctx, "other")
	require.NoError(t, err)
	require.True(t, d.Allowed)
}

// tracedDB stands for a DB of an application's own that wraps a pool (to
// trace or count statements): the limiter must still coalesce on it.
type tracedDB struct {
	*pgxpool.Pool
	statements atomic.Int64
}

func (d *tracedDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	d.statements.Add(1)
	return d.Pool.Query(ctx, sql, args...)
}

func (d *tracedDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	d.statements.Add(1)
	return d.Pool.QueryRow(ctx, sql, args...)
}

// TestCoalescingOnWrappedPool checks that a pool behind a wrapper of the
// application's still coalesces, and that a single connection does not.
func TestCoalescingOnWrappedPool(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(4))
	ctx := context.Background()
	db := &tracedDB{Pool: pool}
	l := testkit.NewLimiter(t, db, ratelimit.Config{Name: "wrapped", Limit: 1_000_000, Window: time.Hour})
	// Checks coalesce only while two round trips are in flight, and a queued
	// check goes out alone after 5 ms: on a busy machine, where a round trip
	// takes longer than that, a round of checks may coalesce none. Run rounds
	// until one does, for at most 30 s.
	checks := 0
	for round, deadline := 0, time.Now().Add(30*time.Second); ratelimit.BatchedChecks(l) == 0 && time.Now().Before(deadline); round++ {
		var wg sync.WaitGroup
		for g := range 32 {
			wg.Go(func() {
				for i := range 50 {
					if _, err := l.Allow(ctx, fmt.Sprintf("k%d-%d-%d", round, g, i)); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		checks += 32 * 50
	}
	batched := ratelimit.BatchedChecks(l)
	t.Logf("%d statements for %d checks, %d of them coalesced", db.statements.Load(), checks, batched)
	require.Positive(t, batched, "32 concurrent callers on a wrapped pool must coalesce")
	require.Less(t, db.statements.Load(), int64(checks))

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	single := testkit.NewLimiter(t, conn.Conn(), ratelimit.Config{Name: "wrapped", Limit: 1_000_000, Window: time.Hour})
	require.False(t, ratelimit.Coalesces(single), "a limiter on a *pgx.Conn must not coalesce")
	require.True(t, ratelimit.Coalesces(l))
}
