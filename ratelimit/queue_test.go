package ratelimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestBatchesMatchSingleChecks is the exactness property of coalescing:
// random batches of checks (keys from a set of three, so that keys repeat
// inside a batch; costs up to the whole limit, often more than is left;
// partial grants; penalty on and off; the clock stepping across window
// edges) decided as the coalescer decides one batch give exactly the
// decisions of the same checks made one at a time, in the same order, by
// single-check statements: every field of every Decision. Without
// penalty (a penalised token bucket takes no slice) some checks are
// slices, coalesced with the others.
func TestBatchesMatchSingleChecks(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				t.Parallel()
				var mu sync.Mutex
				at := base.Add(17 * time.Second)
				clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
				// A long Timeout: on a busy machine a single check must not
				// be answered by the memory fallback.
				cfg := ratelimit.Config{Algorithm: alg, Limit: 10, Window: time.Minute, Penalty: penalty,
					DenyCacheSize: -1}
				bcfg, scfg := cfg, cfg
				bcfg.Name = fmt.Sprintf("prop-batch-%v", penalty) // the subtests share a schema
				scfg.Name = fmt.Sprintf("prop-single-%v", penalty)
				batched := testkit.NewLimiter(t, pool, bcfg, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: clock})
				single := testkit.NewLimiter(t, pool, scfg, ratelimit.DatabaseOptions{Timeout: time.Minute, DisableCoalescing: true, Now: clock})
				rng := rand.New(rand.NewPCG(uint64(len(alg)), map[bool]uint64{false: 1, true: 2}[penalty]))
				queues := 0
				for round := range 150 {
					mu.Lock()
					switch rng.IntN(4) {
					case 0: // stay: same instant
					case 1:
						at = at.Add(time.Duration(rng.Int64N(int64(3 * time.Second))))
					case 2:
						at = at.Add(time.Duration(rng.Int64N(int64(40 * time.Second))))
					default: // across a window edge, to within a microsecond of it
						at = at.Truncate(time.Minute).Add(time.Minute + time.Duration(rng.Int64N(3))*time.Microsecond)
					}
					mu.Unlock()
					n := 1 + rng.IntN(12)
					keys := make([]string, n)
					costs := make([]int64, n)
					upTo := make([]bool, n)
					opts := make([]ratelimit.Option, n)
					seen := map[string]bool{}
					dup, sliced := false, false
					for i := range n {
						keys[i] = fmt.Sprintf("k%d", rng.IntN(3))
						dup = dup || seen[keys[i]]
						seen[keys[i]] = true
						costs[i] = 1
						if rng.IntN(3) == 0 {
							costs[i] = 1 + rng.Int64N(cfg.Limit)
						}
						upTo[i] = rng.IntN(5) == 0
						dup = dup || upTo[i]
						switch {
						case !penalty && rng.IntN(6) == 0:
							lo := min(costs[i], 1+rng.Int64N(2))
							opts[i] = ratelimit.Slice(lo, costs[i], 1+rng.Int64N(3))
							sliced = true
						case upTo[i]:
							opts[i] = ratelimit.UpTo(costs[i])
						default:
							opts[i] = ratelimit.Cost(costs[i])
						}
					}
					if dup {
						queues++
					}
					var got []ratelimit.Decision
					var err error
					if sliced {
						got, err = ratelimit.TakeMixedOptions(ctx, repeat(batched, n), keys, opts)
					} else {
						got, err = ratelimit.TakeBatch(ctx, batched, keys, costs, upTo)
					}
					require.NoError(t, err, "round %d", round)
					for i := range n {
						want, err := single.Allow(ctx, keys[i], opts[i])
						require.NoError(t, err)
						require.Equal(t, want, got[i], "round %d check %d of %v %v", round, i, keys, opts)
					}
				}
				require.Greater(t, queues, 50, "most rounds must exercise the queue statement")
			})
		}
	}
}

// repeat is n times l.
func repeat(l *ratelimit.Limiter, n int) []*ratelimit.Limiter {
	ls := make([]*ratelimit.Limiter, n)
	for i := range ls {
		ls[i] = l
	}
	return ls
}

// TestAllowUpToGrantsWhatIsLeft: per algorithm, the units granted never
// exceed what is left, and equal it when the demand exceeds it; once
// nothing is left a partial grant is a denial with a RetryAfter; under
// penalty the whole demand is counted.
func TestAllowUpToGrantsWhatIsLeft(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "upto", Algorithm: alg, Limit: 100,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			d, err := l.Allow(ctx, "quota", ratelimit.Cost(30))
			require.NoError(t, err)
			require.Equal(t, int64(30), d.Granted)
			left := d.Remaining
			require.Equal(t, int64(70), left)

			d, err = l.Allow(ctx, "quota", ratelimit.UpTo(50)) // demand below what is left
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, int64(50), d.Granted)
			require.Equal(t, int64(20), d.Remaining)

			d, err = l.Allow(ctx, "quota", ratelimit.UpTo(45)) // demand above it: all that is left
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, int64(20), d.Granted)
			require.Zero(t, d.Remaining)
			require.Zero(t, d.RetryAfter)

			d, err = l.Allow(ctx, "quota", ratelimit.UpTo(1))
			require.NoError(t, err)
			require.False(t, d.Allowed)
			require.Zero(t, d.Granted)
			require.Positive(t, d.RetryAfter)

			// The memory tier grants the same way.
			m, err := ratelimit.NewMemory(l.Config(), ratelimit.MemoryOptions{})
			require.NoError(t, err)
			for _, c := range []struct{ n, want int64 }{{30, 30}, {50, 50}, {45, 20}, {1, 0}} {
				md, err := m.Allow(ctx, "quota", ratelimit.UpTo(c.n))
				require.NoError(t, err)
				require.Equal(t, c.want, md.Granted, "memory, demand %d", c.n)
			}

			// Penalty: everything asked is counted.
			p := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "upto-penalty", Algorithm: alg, Limit: 100,
				Window: time.Hour, Penalty: true, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			d, err = p.Allow(ctx, "quota", ratelimit.UpTo(80))
			require.NoError(t, err)
			require.Equal(t, int64(80), d.Granted)
			d, err = p.Allow(ctx, "quota", ratelimit.UpTo(50))
			require.NoError(t, err)
			require.Equal(t, int64(20), d.Granted)
			require.Equal(t, int64(130), d.Used, "all 50 counted")
		})
	}
}

// TestAllowUpToConcurrentNeverOverGrants: 32 goroutines take partial grants
// of random size from one key through the coalescer; the grants add up to
// exactly the limit.
func TestAllowUpToConcurrentNeverOverGrants(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(8))
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "upto-conc", Algorithm: alg, Limit: 1000,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			var mu sync.Mutex
			var total int64
			var wg sync.WaitGroup
			for g := range 32 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 7))
					for range 20 {
						d, err := l.Allow(ctx, "shared", ratelimit.UpTo(1+rng.Int64N(10)))
						if err != nil {
							t.Error(err)
							return
						}
						mu.Lock()
						total += d.Granted
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			require.LessOrEqual(t, total, int64(1000))
			// 640 checks asking 5.5 units on average ask for more than 1000.
			require.Equal(t, int64(1000), total)
		})
	}
}

// TestSharedStatementsMatchSingleChecks: checks of six limiters (three
// algorithms, different limits, windows and penalty settings) on one pool
// share one coalescer, and one batch of them, decided one statement per
// algorithm, gives exactly the decisions of the same checks made one at a
// time in the same order, slices of the limiters without penalty
// included.
func TestSharedStatementsMatchSingleChecks(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	var mu sync.Mutex
	at := base.Add(17 * time.Second)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
	cfgs := []ratelimit.Config{
		{Name: "fw-a", Algorithm: ratelimit.FixedWindow, Limit: 10, Window: time.Minute},
		{Name: "fw-b", Algorithm: ratelimit.FixedWindow, Limit: 4, Window: 10 * time.Second, Penalty: true},
		{Name: "tb-a", Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: 15, Window: time.Minute},
		{Name: "tb-b", Algorithm: ratelimit.TokenBucket, Limit: 3, Window: 5 * time.Second, Penalty: true},
		{Name: "sw-a", Algorithm: ratelimit.SlidingWindow, Limit: 7, Window: 30 * time.Second},
		{Name: "sw-b", Algorithm: ratelimit.SlidingWindow, Limit: 12, Window: 2 * time.Minute, Penalty: true},
	}
	var shared, single []*ratelimit.Limiter
	sharedDB := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: clock})
	for _, cfg := range cfgs {
		cfg.DenyCacheSize = -1
		shared = append(shared, testkit.Limiter(t, sharedDB, cfg))
		cfg.Name += "-single"
		single = append(single, testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: clock}))
	}
	for _, l := range shared[1:] {
		require.True(t, ratelimit.SharesCoalescer(shared[0], l), "limiters of one Database share a coalescer")
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 120 {
		mu.Lock()
		at = at.Add(time.Duration(rng.Int64N(int64(4 * time.Second))))
		mu.Unlock()
		n := 1 + rng.IntN(16)
		ls := make([]*ratelimit.Limiter, n)
		idx := make([]int, n)
		keys := make([]string, n)
		opts := make([]ratelimit.Option, n)
		for i := range n {
			idx[i] = rng.IntN(len(cfgs))
			ls[i] = shared[idx[i]]
			keys[i] = fmt.Sprintf("k%d", rng.IntN(2))
			cost := 1 + rng.Int64N(3)
			switch r := rng.IntN(6); {
			case r == 0:
				opts[i] = ratelimit.UpTo(cost)
			case r == 1 && !cfgs[idx[i]].Penalty: // a penalised token bucket takes no slice
				opts[i] = ratelimit.Slice(1, cost, 1+rng.Int64N(2))
			default:
				opts[i] = ratelimit.Cost(cost)
			}
		}
		got, err := ratelimit.TakeMixedOptions(ctx, ls, keys, opts)
		require.NoError(t, err, "round %d", round)
		for i := range n {
			want, err := single[idx[i]].Allow(ctx, keys[i], opts[i])
			require.NoError(t, err)
			require.Equal(t, want, got[i], "round %d check %d (%s)", round, i, cfgs[idx[i]].Name)
		}
	}
}

// TestQueueFunctionMissingFallsBack: against a schema whose check function
// is missing (migrated to 14, or revoked), a batch holding a key twice is
// decided one check at a time, correctly, and the limiter logs once what to
// run.
func TestQueueFunctionMissingFallsBack(t *testing.T) {
	t.Parallel()
	pool, schemaName := dbtest.Pool(t)
	ctx := context.Background()
	_, err := dbtest.Admin(t).Exec(ctx, "DROP FUNCTION "+pgx.Identifier{schemaName, "pgrl_fixed_window_take_checks"}.Sanitize()+
		"(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz)")
	require.NoError(t, err)
	var logs testkit.LogBuffer
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "no-queue", Limit: 3, Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: testkit.Pinned(base)})
	ls := []*ratelimit.Limiter{l, l, l, l}
	got, err := ratelimit.TakeMixed(ctx, ls, []string{"k", "k", "k", "k"}, []int64{1, 1, 1, 1}, make([]bool, 4))
	require.NoError(t, err)
	for i, d := range got {
		require.Equal(t, i < 3, d.Allowed, "check %d", i)
	}
	require.Contains(t, logs.String(), "run `rl-migrate up`")
}

// TestGroupsMatchSequentialDecisions: one check statement holding lone
// checks and all-or-nothing groups of several limiters of one algorithm,
// interleaved on two keys, decides each exactly as the same requests made
// one after another would be: a lone check as Allow with Cost or UpTo, a group
// as AllowAllTx, whose savepoint and vote roll back a denied group. A
// denied group changes no row, so the checks after it see the rows as they
// were before it.
func TestGroupsMatchSequentialDecisions(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			at := base.Add(17 * time.Second)
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
			cfgs := []ratelimit.Config{
				{Name: "g-a", Limit: 6, Window: time.Minute},
				{Name: "g-b", Limit: 4, Window: 20 * time.Second, Penalty: true},
				{Name: "g-c", Limit: 9, Burst: 12, Window: 2 * time.Minute},
				{Name: "g-s", Limit: 3, Window: time.Minute, Shadow: true},
			}
			var shared, single []*ratelimit.Limiter
			sharedDB := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: clock})
			singleDB := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: clock})
			for _, cfg := range cfgs {
				cfg.Algorithm, cfg.DenyCacheSize = alg, -1
				if alg != ratelimit.TokenBucket {
					cfg.Burst = 0
				}
				shared = append(shared, testkit.Limiter(t, sharedDB, cfg))
				cfg.Name += "-seq"
				single = append(single, testkit.Limiter(t, singleDB, cfg))
			}
			rng := rand.New(rand.NewPCG(5, uint64(len(alg))))
			var groupsDenied, groupsAllowed int
			for round := range 80 {
				mu.Lock()
				at = at.Add(time.Duration(rng.Int64N(int64(3 * time.Second))))
				mu.Unlock()
				var ls []*ratelimit.Limiter
				var idx []int
				var keys []string
				var costs []int64
				var upTo []bool
				var groups []int32
				for g := range int32(1 + rng.IntN(6)) {
					if rng.IntN(2) == 0 {
						// A lone check.
						i := rng.IntN(len(cfgs))
						ls, idx = append(ls, shared[i]), append(idx, i)
						keys = append(keys, fmt.Sprintf("k%d", rng.IntN(2)))
						costs = append(costs, 1+rng.Int64N(3))
						upTo = append(upTo, rng.IntN(5) == 0)
						groups = append(groups, 0)
						continue
					}
					// A group: two or three limiters, one key each.
					for _, i := range rng.Perm(len(cfgs))[:2+rng.IntN(2)] {
						ls, idx = append(ls, shared[i]), append(idx, i)
						keys = append(keys, fmt.Sprintf("k%d", rng.IntN(2)))
						costs = append(costs, 1+rng.Int64N(3))
						upTo = append(upTo, false)
						groups = append(groups, g+1)
					}
				}
				got, err := ratelimit.TakeGroups(ctx, ls, keys, costs, upTo, groups)
				require.NoError(t, err, "round %d", round)
				for i := 0; i < len(ls); {
					if groups[i] == 0 {
						var want ratelimit.Decision
						if upTo[i] {
							want, err = single[idx[i]].Allow(ctx, keys[i], ratelimit.UpTo(costs[i]))
						} else {
							want, err = single[idx[i]].Allow(ctx, keys[i], ratelimit.Cost(costs[i]))
						}
						require.NoError(t, err)
						require.Equal(t, want, got[i], "round %d check %d (%s)", round, i, cfgs[idx[i]].Name)
						i++
						continue
					}
					end := i
					var checks []ratelimit.Check
					for ; end < len(ls) && groups[end] == groups[i]; end++ {
						checks = append(checks, ratelimit.Check{Limiter: single[idx[end]], Key: keys[end], Cost: costs[end]})
					}
					want, err := allowAllCommitted(ctx, pool, checks)
					require.NoError(t, err)
					if want.Allowed {
						groupsAllowed++
					} else {
						groupsDenied++
					}
					require.Equal(t, want.Decisions, got[i:end], "round %d group at %d", round, i)
					i = end
				}
			}
			require.Positive(t, groupsDenied, "some groups were denied")
			require.Positive(t, groupsAllowed, "some groups were allowed")
		})
	}
}

// allowAllCommitted is AllowAllTx in a transaction of its own, committed.
func allowAllCommitted(ctx context.Context, pool *pgxpool.Pool, checks []ratelimit.Check) (ratelimit.MultiDecision, error) {
	var m ratelimit.MultiDecision
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		m, err = ratelimit.AllowAllTx(ctx, tx, ratelimit.AllOrNothing, checks...)
		return err
	})
	return m, err
}

// TestRunsMatchSingleChecks is the exactness property of the run
// statements (…TakeRuns), which decide a batch of checks of one unit with
// keys repeating: random batches (keys from a set of three; limits of 1 to
// 4, so that runs are cut short; the clock staying, moving on, crossing
// window edges and stepping back) give exactly the decisions of the same
// checks made one at a time, in order, by single-check statements: every
// field of every Decision. For the token bucket some rounds first lease a
// slice of a key, which the run statement counts against its capacity.
func TestRunsMatchSingleChecks(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			at := base.Add(17 * time.Second)
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
			rng := rand.New(rand.NewPCG(uint64(len(alg)), 7))
			limit := 1 + rng.Int64N(4)
			cfg := ratelimit.Config{Algorithm: alg, Limit: limit, Window: time.Minute, DenyCacheSize: -1}
			bcfg, scfg := cfg, cfg
			bcfg.Name, scfg.Name = "runs-batch", "runs-single"
			var logs testkit.LogBuffer
			opts := ratelimit.DatabaseOptions{Timeout: time.Minute, Now: clock, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
			batched := testkit.NewLimiter(t, pool, bcfg, opts)
			opts.DisableCoalescing = true
			single := testkit.NewLimiter(t, pool, scfg, opts)
			ran, denied := 0, 0
			for round := range 200 {
				mu.Lock()
				switch rng.IntN(5) {
				case 0: // stay: same instant
				case 1:
					at = at.Add(time.Duration(rng.Int64N(int64(5 * time.Second))))
				case 2:
					at = at.Add(time.Duration(rng.Int64N(int64(40 * time.Second))))
				case 3: // a step back
					at = at.Add(-time.Duration(rng.Int64N(int64(10 * time.Second))))
				default: // across a window edge, to within a microsecond of it
					at = at.Truncate(time.Minute).Add(time.Minute + time.Duration(rng.Int64N(3))*time.Microsecond)
				}
				mu.Unlock()
				if alg == ratelimit.TokenBucket && rng.IntN(8) == 0 {
					// A slice on lease: less capacity for the checks.
					key := fmt.Sprintf("k%d", rng.IntN(3))
					for _, l := range []*ratelimit.Limiter{batched, single} {
						_, err := l.Allow(ctx, key, ratelimit.Slice(1, 1, 1))
						require.NoError(t, err)
					}
				}
				n := 2 + rng.IntN(10)
				keys := make([]string, n)
				for i := range n {
					keys[i] = fmt.Sprintf("k%d", rng.IntN(3))
				}
				got, runs, err := ratelimit.TakeRunsBatch(ctx, batched, keys)
				require.NoError(t, err, "round %d", round)
				ran += runs
				for i := range n {
					want, err := single.Allow(ctx, keys[i])
					require.NoError(t, err)
					require.Equal(t, want, got[i], "round %d check %d of %v", round, i, keys)
					if !want.Allowed {
						denied++
					}
				}
			}
			t.Logf("%d checks decided by the run statement, %d denied", ran, denied)
			require.Greater(t, denied, 100, "runs must be cut short")
			var citus bool
			require.NoError(t, pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')").Scan(&citus))
			if citus {
				// Citus refuses the statement: the check statements decide.
				require.Zero(t, ran)
				require.Contains(t, logs.String(), "does not run the run statement")
				t.Logf("refused: %s", strings.SplitN(logs.String(), "\n", 2)[0])
				return
			}
			require.Greater(t, ran, 500, "most checks must go through the run statement")
		})
	}
}
