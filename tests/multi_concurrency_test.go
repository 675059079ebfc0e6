package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// multiAt is the pinned instant of the multi-limit tests: every decision
// falls in the same window, so the counters compare exactly.
var multiAt = time.Date(2030, 6, 1, 12, 0, 0, 0, time.UTC)

// multiLimits are the limits of the four limiters the multi-limit test
// mixes; each has multiKeysPer keys.
var multiLimits = []int64{40, 90, 200, 400}

const multiKeysPer = 5

// multiTarget is one (limiter, key) pair of the multi-limit test.
type multiTarget struct {
	lim int // index into the limiters
	key string
}

// exactTimeout is the Timeout of the limiters whose tests count exactly
// under concurrency: what they test is the count, and the default timeout
// (ratelimit.DefaultTimeout) would hand a check that an overloaded test
// machine (the race detector, a CPU load beside the suite) answers late to
// the failure policy, which counts in process memory.
const exactTimeout = time.Minute

// multiLimiters builds the test's limiters on db, from one Database: the
// limits of one AllowAll.
func multiLimiters(t *testing.T, db ratelimit.DB) []*ratelimit.Limiter {
	var ls []*ratelimit.Limiter
	d := testkit.NewDatabase(t, db, ratelimit.DatabaseOptions{Timeout: exactTimeout, Now: func() time.Time { return multiAt }})
	for i, limit := range multiLimits {
		ls = append(ls, testkit.Limiter(t, d, ratelimit.Config{
			Name: fmt.Sprintf("multi-%d", i), Limit: limit, Window: time.Hour,
			DenyCacheSize: -1, // every decision goes to PostgreSQL and locks its rows
		}))
	}
	return ls
}

// multiCounters reads each target's counter from the fixed-window table.
func multiCounters(t *testing.T, pool *pgxpool.Pool, ls []*ratelimit.Limiter, targets []multiTarget) []int64 {
	out := make([]int64, len(targets))
	for i, tg := range targets {
		err := pool.QueryRow(context.Background(), "SELECT coalesce(sum(count), 0) FROM pgrl_fixed_window WHERE key = $1",
			multiprocessHashedKey(ls[tg.lim].Config().Name, tg.key)).Scan(&out[i])
		require.NoError(t, err)
	}
	return out
}

// TestMultiConcurrentOverlappingNoDeadlock has 8 goroutines decide random
// sets of 3 limits out of 20 (limiter, key) pairs, overlapping, for 30 s (5 s
// with -short), all-or-nothing, with small limits so that denials are
// frequent. No decision fails (no deadlock, SQLSTATE 40P01, nor any other
// error); every counter equals the sum of the costs of the admitted
// decisions containing it and stays within its limit; and a sequential
// replay of the admitted decisions, in completion order, on a fresh schema
// admits every one and ends with identical counters.
func TestMultiConcurrentOverlappingNoDeadlock(t *testing.T) {
	duration := 30 * time.Second
	if testing.Short() {
		duration = 5 * time.Second
	}
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(8))
	ls := multiLimiters(t, pool)
	var targets []multiTarget
	for i := range ls {
		for k := range multiKeysPer {
			targets = append(targets, multiTarget{i, fmt.Sprintf("key-%d", k)})
		}
	}

	type pick struct {
		target int
		cost   int64
	}
	var (
		mu       sync.Mutex
		admitted [][]pick // in completion order
		denied   int
		errs     []error
	)
	ctx := context.Background()
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 99))
			for time.Now().Before(deadline) {
				idx := rng.Perm(len(targets))[:3]
				picks := make([]pick, 3)
				checks := make([]ratelimit.Check, 3)
				for i, ti := range idx {
					picks[i] = pick{ti, 1 + rng.Int64N(2)}
					checks[i] = ratelimit.Check{Limiter: ls[targets[ti].lim], Key: targets[ti].key, Cost: picks[i].cost}
				}
				m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
				mu.Lock()
				switch {
				case err != nil:
					errs = append(errs, err)
				case m.Allowed:
					for _, d := range m.Decisions {
						if d.Store != ratelimit.StorePostgres {
							errs = append(errs, fmt.Errorf("decision answered by %s: %s", d.Store, d.Reason))
						}
					}
					admitted = append(admitted, picks)
				default:
					denied++
				}
				stop := len(errs) > 0
				mu.Unlock()
				if stop {
					return
				}
			}
		}()
	}
	wg.Wait()

	deadlocks := 0
	for _, err := range errs {
		if errorsAsPg(err, "40P01") {
			deadlocks++
		}
	}
	t.Logf("%v: %d decisions admitted, %d denied, %d errors (%d deadlocks)", duration, len(admitted), denied, len(errs), deadlocks)
	require.Zero(t, deadlocks, "no deadlock")
	require.Empty(t, errs, "no error at all")
	require.Positive(t, denied, "denials happened")
	require.Positive(t, len(admitted), "admissions happened")

	want := make([]int64, len(targets))
	for _, ps := range admitted {
		for _, p := range ps {
			want[p.target] += p.cost
		}
	}
	got := multiCounters(t, pool, ls, targets)
	exhausted := 0
	for i, tg := range targets {
		limit := multiLimits[tg.lim]
		require.Equal(t, want[i], got[i], "counter of %s/%s equals the admitted costs", ls[tg.lim].Config().Name, tg.key)
		require.LessOrEqual(t, got[i], limit, "counter of %s/%s within its limit", ls[tg.lim].Config().Name, tg.key)
		if got[i] >= limit-1 {
			exhausted++
		}
	}
	t.Logf("counters %v; %d of %d pairs at their limit", got, exhausted, len(targets))

	// Sequential replay on a fresh schema.
	pool2, _ := dbtest.Pool(t)
	ls2 := multiLimiters(t, pool2)
	for i, ps := range admitted {
		checks := make([]ratelimit.Check, len(ps))
		for j, p := range ps {
			checks[j] = ratelimit.Check{Limiter: ls2[targets[p.target].lim], Key: targets[p.target].key, Cost: p.cost}
		}
		m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
		require.NoError(t, err)
		require.True(t, m.Allowed, "replayed decision %d is admitted", i)
	}
	require.Equal(t, got, multiCounters(t, pool2, ls2, targets), "the replay ends with identical counters")
}

// multiSingleAlgorithmConsumes reports whether an all-or-nothing decision
// whose checks are all fixed-window limits consumes what it admits.
func multiSingleAlgorithmConsumes(t *testing.T) bool {
	pool, _ := dbtest.Pool(t)
	l, err := testkit.New(pool, ratelimit.Config{Name: "single", Limit: 2, Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: exactTimeout})
	require.NoError(t, err)
	ctx := context.Background()
	m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
	require.NoError(t, err)
	require.True(t, m.Allowed)
	d, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	return d.Remaining == 1
}

// TestMultiSingleAlgorithmConsumes: an all-or-nothing decision whose checks
// use only some of the three algorithms must consume what it admits.
// (Regression test: nil key arrays of the absent algorithms once reached
// the vote as NULL, which rolled every such decision back while reporting
// it allowed.)
func TestMultiSingleAlgorithmConsumes(t *testing.T) {
	t.Parallel()
	ok := multiSingleAlgorithmConsumes(t)
	require.True(t, ok, "an admitted all-or-nothing decision over one algorithm consumes its cost")
}

// TestMultiBadInputsConsumeNothing covers the multi-limit bad inputs that
// ratelimit's own tests leave out: the same limit and key reached through
// two Limiter values of the same name, a zero cost (which means 1), a
// negative cost among valid checks, and an unknown mode. Each gives its
// typed error and consumes nothing.
func TestMultiBadInputsConsumeNothing(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	d := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: exactTimeout}) // the limits of one AllowAll
	mk := func(name string, limit int64) *ratelimit.Limiter {
		return testkit.Limiter(t, d, ratelimit.Config{Name: name, Limit: limit, Window: time.Hour})
	}
	a, a2, b := mk("same", 3), mk("same", 3), mk("other", 3)

	_, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: b, Key: "k"},
		ratelimit.Check{Limiter: a, Key: "k"}, ratelimit.Check{Limiter: a2, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrDuplicateCheck, "two limiters of one name share counters: the same check twice")
	_, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: b, Key: "k"},
		ratelimit.Check{Limiter: a, Key: "k", Cost: -2})
	require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	_, err = ratelimit.AllowAll(ctx, ratelimit.MultiMode(7), ratelimit.Check{Limiter: b, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrInvalidMultiMode)
	_, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: b, Key: "k"},
		ratelimit.Check{Limiter: a, Key: "k", Cost: 4})
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)

	var rows int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_fixed_window").Scan(&rows))
	require.Zero(t, rows, "nothing was written by the refused decisions")

	m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: a, Key: "k", Cost: 0})
	require.NoError(t, err)
	require.True(t, m.Allowed)
	require.Equal(t, int64(2), m.Decisions[0].Remaining, "a zero cost counts as 1")
}
