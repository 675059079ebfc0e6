package ratelimit_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// requireShadowDenied asserts a shadow-mode denial: allowed, flagged, and
// granted nothing, since the limit took nothing for it.
func requireShadowDenied(t *testing.T, d ratelimit.Decision, msg string) {
	t.Helper()
	require.True(t, d.Allowed, "%s: shadow mode never denies", msg)
	require.True(t, d.ShadowDenied, "%s: the limit would have denied", msg)
	require.Zero(t, d.Granted, "%s: the limit would have granted nothing", msg)
	require.Zero(t, d.RetryAfter, msg)
}

// TestShadowReportsTheGrantItWouldMake: a shadow-mode denial proceeds but
// reports what the limit granted, nothing, on every path that can answer a
// check: the single statement, the deny cache, the coalesced queue, the
// caller's transaction, AllowAll, a stored policy, a MemoryLimiter, the
// failure policies, and the Observer that sees them.
func TestShadowReportsTheGrantItWouldMake(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			cfg := func(name string) ratelimit.Config {
				return ratelimit.Config{Name: name + "-" + string(alg), Algorithm: alg, Limit: 5, Window: time.Hour,
					Shadow: true}
			}
			// The Database of the limits of cfg.
			opts := ratelimit.DatabaseOptions{Logger: quiet, Timeout: time.Minute, Now: testkit.Pinned(base)}
			// exhaust runs the sequence through allowN and allowUpTo.
			exhaust := func(t *testing.T, what string, allowN, allowUpTo func(int64) (ratelimit.Decision, error)) {
				t.Helper()
				d, err := allowN(5)
				require.NoError(t, err)
				require.True(t, d.Allowed)
				require.False(t, d.ShadowDenied)
				require.Equal(t, int64(5), d.Granted, what)
				for i := range 3 { // the second and third may come from the deny cache
					d, err = allowN(2)
					require.NoError(t, err)
					requireShadowDenied(t, d, fmt.Sprintf("%s: AllowN(2) #%d", what, i))
					require.Equal(t, int64(5), d.Limit, what)
				}
				if allowUpTo != nil {
					for i := range 2 {
						d, err = allowUpTo(4)
						require.NoError(t, err)
						requireShadowDenied(t, d, fmt.Sprintf("%s: AllowUpTo(4) #%d", what, i))
					}
				}
			}

			t.Run("single", func(t *testing.T) {
				for _, deny := range []int{-1, 0} {
					c := cfg(fmt.Sprintf("single%d", deny))
					c.DenyCacheSize = deny
					obs := &testkit.Observer{}
					o := opts
					o.DisableCoalescing, o.Observer = true, obs
					l := testkit.NewLimiter(t, pool, c, o)
					exhaust(t, c.Name,
						func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.Cost(n)) },
						func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.UpTo(n)) })
					seen := obs.Decisions()
					require.Len(t, seen, 6)
					for _, d := range seen[1:] {
						requireShadowDenied(t, d, c.Name+": observed")
					}
				}
			})
			t.Run("coalesced", func(t *testing.T) {
				// Concurrent checks of one key share queue statements; the
				// grants add up to the limit exactly.
				l := testkit.NewLimiter(t, pool, cfg("coalesced"), opts)
				require.True(t, ratelimit.Coalesces(l))
				var mu sync.Mutex
				var granted, shadowed int64
				var wg sync.WaitGroup
				for g := range 16 {
					wg.Go(func() {
						for range 8 {
							var d ratelimit.Decision
							var err error
							if g%2 == 0 {
								d, err = l.Allow(ctx, "k")
							} else {
								d, err = l.Allow(ctx, "k", ratelimit.UpTo(3))
							}
							if !assertNoError(t, err) {
								return
							}
							mu.Lock()
							granted += d.Granted
							if d.ShadowDenied {
								shadowed++
								if d.Granted != 0 {
									t.Errorf("shadow denial granted %d", d.Granted)
								}
							}
							mu.Unlock()
						}
					})
				}
				wg.Wait()
				require.Equal(t, int64(5), granted, "the grants add up to what the limit counted")
				require.Positive(t, shadowed)
			})
			t.Run("tx", func(t *testing.T) {
				l := testkit.NewLimiter(t, pool, cfg("tx"), opts)
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				exhaust(t, "tx",
					func(n int64) (ratelimit.Decision, error) { return l.AllowTx(ctx, tx, "k", ratelimit.Cost(n)) },
					func(n int64) (ratelimit.Decision, error) { return l.AllowTx(ctx, tx, "k", ratelimit.UpTo(n)) })
			})
			t.Run("allow-all", func(t *testing.T) {
				// One Database: the decision rides one coalescer. The
				// Observer sees other's decisions too, never shadow denials.
				obs := &testkit.Observer{}
				o := opts
				o.Observer = obs
				db := testkit.NewDatabase(t, pool, o)
				shadow := testkit.Limiter(t, db, cfg("all"))
				other := testkit.Limiter(t, db, ratelimit.Config{Name: "all-other-" + string(alg), Algorithm: alg, Limit: 100, Window: time.Hour})
				for _, mode := range []ratelimit.MultiMode{ratelimit.AllOrNothing, ratelimit.ConsumeAll} {
					key := fmt.Sprintf("k%d", mode)
					exhaust(t, fmt.Sprintf("AllowAll mode %d", mode), func(n int64) (ratelimit.Decision, error) {
						m, err := ratelimit.AllowAll(ctx, mode, ratelimit.Check{Limiter: shadow, Key: key, Cost: n},
							ratelimit.Check{Limiter: other, Key: key})
						if err != nil {
							return ratelimit.Decision{}, err
						}
						require.True(t, m.Allowed)
						require.Equal(t, int64(1), m.Decisions[1].Granted)
						return m.Decisions[0], nil
					}, nil)
				}
				for _, d := range obs.Decisions() {
					if d.ShadowDenied {
						require.Zero(t, d.Granted, "observed")
					}
				}
			})
			t.Run("policy", func(t *testing.T) {
				c := cfg("pol")
				c.Policy = c.Name
				setPolicy(t, pool, c.Policy, alg, 5, time.Hour, 0, false)
				l := testkit.NewLimiter(t, pool, c, opts)
				exhaust(t, "policy",
					func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.Cost(n)) },
					func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.UpTo(n)) })
			})
			t.Run("memory", func(t *testing.T) {
				obs := &testkit.Observer{}
				m, err := ratelimit.NewMemory(cfg("mem"), ratelimit.MemoryOptions{Observer: obs, Logger: quiet, Now: opts.Now})
				require.NoError(t, err)
				exhaust(t, "memory",
					func(n int64) (ratelimit.Decision, error) { return m.Allow(ctx, "k", ratelimit.Cost(n)) },
					func(n int64) (ratelimit.Decision, error) { return m.Allow(ctx, "k", ratelimit.UpTo(n)) })
				seen := obs.Decisions()
				require.Len(t, seen, 6)
				for _, d := range seen[1:] {
					requireShadowDenied(t, d, "memory: observed")
				}
			})
			t.Run("failure-policy", func(t *testing.T) {
				dead := testkit.DeadPool(t)
				c := cfg("dead-memory")
				o := opts
				o.Timeout = 200 * time.Millisecond
				c.OnFailure = ratelimit.FailToMemory
				l := testkit.NewLimiter(t, dead, c, o)
				exhaust(t, "fail to memory",
					func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.Cost(n)) },
					func(n int64) (ratelimit.Decision, error) { return l.Allow(ctx, "k", ratelimit.UpTo(n)) })
				c = cfg("dead-closed")
				c.OnFailure = ratelimit.FailClosed
				l = testkit.NewLimiter(t, dead, c, o)
				for _, upTo := range []bool{false, true} {
					ask := ratelimit.Cost(2)
					if upTo {
						ask = ratelimit.UpTo(2)
					}
					d, err := l.Allow(ctx, "k", ask)
					require.NoError(t, err)
					require.Equal(t, ratelimit.StorePolicy, d.Store)
					requireShadowDenied(t, d, fmt.Sprintf("fail closed, upTo=%v", upTo))
				}
			})
		})
	}
}

// assertNoError reports err from a goroutine other than the test's.
func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// hugeAsks are asks of a partial grant around and far above a limit of 10,
// up to the largest int64.
var hugeAsks = []int64{1, 5, 6, 9, 10, 11, 25, 1 << 53, math.MaxInt64 - 1, math.MaxInt64}

// TestPartialGrantAskIsACeiling is the property of UpTo's ask: it is a
// ceiling, not a cost. With a limit of 10 and u units used, an ask of n
// grants min(n, 10-u) and, under Penalty, charges min(n, 10): an ask above
// the capacity is an ask of the capacity in every field of the Decision.
// It holds on every path (single statement, queue statement, the caller's
// transaction, a stored policy's limiter, a MemoryLimiter, the memory
// fallback), for every algorithm, with and without Penalty, for asks up to
// math.MaxInt64.
func TestPartialGrantAskIsACeiling(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	type path struct {
		name string
		// upTo brings key to used (when positive) and then asks for n.
		upTo func(t *testing.T, key string, used, n int64) (ratelimit.Decision, error)
	}
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				t.Parallel()
				cfg := func(name string) ratelimit.Config {
					return ratelimit.Config{Name: fmt.Sprintf("%s-%s-%v", name, alg, penalty), Algorithm: alg,
						Limit: 10, Window: time.Hour, Penalty: penalty, DenyCacheSize: -1}
				}
				// The Database of the limits of cfg.
				opts := ratelimit.DatabaseOptions{Logger: quiet, Timeout: time.Minute, Now: testkit.Pinned(base)}
				viaLimiter := func(l *ratelimit.Limiter) func(*testing.T, string, int64, int64) (ratelimit.Decision, error) {
					return func(t *testing.T, key string, used, n int64) (ratelimit.Decision, error) {
						if used > 0 {
							_, err := l.Allow(ctx, key, ratelimit.Cost(used))
							require.NoError(t, err)
						}
						return l.Allow(ctx, key, ratelimit.UpTo(n))
					}
				}
				single := opts
				single.DisableCoalescing = true
				queued := testkit.NewLimiter(t, pool, cfg("queue"), opts)
				inTx := testkit.NewLimiter(t, pool, cfg("tx"), opts)
				pol := cfg("pol")
				pol.Policy = pol.Name
				setPolicy(t, pool, pol.Policy, alg, 10, time.Hour, 0, penalty)
				mem, err := ratelimit.NewMemory(cfg("memory"), ratelimit.MemoryOptions{Logger: quiet, Now: opts.Now})
				require.NoError(t, err)
				fallback := cfg("fallback")
				fallback.OnFailure = ratelimit.FailToMemory
				fallbackOpts := opts
				fallbackOpts.Timeout = 200 * time.Millisecond
				paths := []path{
					{"single", viaLimiter(testkit.NewLimiter(t, pool, cfg("single"), single))},
					{"queue", func(t *testing.T, key string, used, n int64) (ratelimit.Decision, error) {
						// One queue statement: the setup and the ask.
						keys, costs, upTo := []string{key}, []int64{n}, []bool{true}
						if used > 0 {
							keys, costs, upTo = []string{key, key}, []int64{used, n}, []bool{false, true}
						}
						ds, err := ratelimit.TakeBatch(ctx, queued, keys, costs, upTo)
						if err != nil {
							return ratelimit.Decision{}, err
						}
						return ds[len(ds)-1], nil
					}},
					{"tx", func(t *testing.T, key string, used, n int64) (ratelimit.Decision, error) {
						tx, err := pool.Begin(ctx)
						require.NoError(t, err)
						defer func() { require.NoError(t, tx.Commit(ctx)) }()
						if used > 0 {
							_, err := inTx.AllowTx(ctx, tx, key, ratelimit.Cost(used))
							require.NoError(t, err)
						}
						return inTx.AllowTx(ctx, tx, key, ratelimit.UpTo(n))
					}},
					{"policy", viaLimiter(testkit.NewLimiter(t, pool, pol, opts))},
					{"memory", func(t *testing.T, key string, used, n int64) (ratelimit.Decision, error) {
						if used > 0 {
							_, err := mem.Allow(ctx, key, ratelimit.Cost(used))
							require.NoError(t, err)
						}
						return mem.Allow(ctx, key, ratelimit.UpTo(n))
					}},
					{"fallback", viaLimiter(testkit.NewLimiter(t, testkit.DeadPool(t), fallback, fallbackOpts))},
				}
				for _, p := range paths {
					t.Run(p.name, func(t *testing.T) { ceilingHolds(t, penalty, p.name, p.upTo) })
				}
			})
		}
	}
}

// ceilingHolds checks TestPartialGrantAskIsACeiling's property on one path.
func ceilingHolds(t *testing.T, penalty bool, name string, upTo func(*testing.T, string, int64, int64) (ratelimit.Decision, error)) {
	for _, used := range []int64{0, 4, 10} {
		for _, n := range hugeAsks {
			what := fmt.Sprintf("%s: %d used, ask %d", name, used, n)
			d, err := upTo(t, fmt.Sprintf("%d/%d", used, n), used, n)
			require.NoError(t, err, what)
			// The same ask capped at the capacity, on a key in the same state.
			want, err := upTo(t, fmt.Sprintf("%d/%d/capped", used, n), used, min(n, 10))
			require.NoError(t, err, what)
			require.Equal(t, want, d, "%s: an ask above the capacity is an ask of the capacity", what)
			require.Equal(t, min(n, 10-used), d.Granted, what)
			require.Equal(t, d.Granted > 0, d.Allowed, what)
			charged := d.Granted
			if penalty {
				charged = min(n, 10)
			}
			require.Equal(t, used+charged, d.Used, "%s: what was counted", what)
		}
	}
}

// TestPartialGrantAskAboveCapacityElsewhere: the other answers to a partial
// grant take an ask above the capacity as the capacity too: a spread
// limit's row (its share), FailOpen (which grants the whole ask), and the
// floor of 1 unit still holds.
func TestPartialGrantAskAboveCapacityElsewhere(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			name := fmt.Sprintf("%s-%v", alg, penalty)
			// Two rows of 10: each partial grant takes one row's share.
			spread := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "spread-" + name, Algorithm: alg, Limit: 20, Window: time.Hour, Spread: 2, Penalty: penalty, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: testkit.Pinned(base)})
			for i, want := range []int64{10, 10, 0} {
				d, err := spread.Allow(ctx, "k", ratelimit.UpTo(math.MaxInt64))
				require.NoError(t, err, "%s: grant %d", name, i)
				require.Equal(t, want, d.Granted, "%s: grant %d", name, i)
				require.Equal(t, int64(20), d.Limit)
				if i == 0 {
					require.Equal(t, int64(20), d.Used, "%s: the row counted its share, shown for the whole limit", name)
				}
			}
			open := testkit.NewLimiter(t, testkit.DeadPool(t), ratelimit.Config{Name: "open-" + name, Algorithm: alg, Limit: 10, Window: time.Hour, Penalty: penalty, OnFailure: ratelimit.FailOpen}, ratelimit.DatabaseOptions{Timeout: 200 * time.Millisecond, Logger: quiet})
			for _, n := range hugeAsks {
				d, err := open.Allow(ctx, "k", ratelimit.UpTo(n))
				require.NoError(t, err)
				require.Equal(t, ratelimit.StorePolicy, d.Store)
				require.True(t, d.Allowed)
				require.Equal(t, min(n, 10), d.Granted, "%s: fail open grants the ask, at most the capacity", name)
			}
			for _, n := range []int64{0, -1, math.MinInt64} {
				_, err := spread.Allow(ctx, "k", ratelimit.UpTo(n))
				require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
				_, err = open.Allow(ctx, "k", ratelimit.UpTo(n))
				require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
				m, err := ratelimit.NewMemory(ratelimit.Config{Name: "m", Algorithm: alg, Limit: 10, Window: time.Hour}, ratelimit.MemoryOptions{})
				require.NoError(t, err)
				_, err = m.Allow(ctx, "k", ratelimit.UpTo(n))
				require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
			}
		}
	}
}

// TestPartialGrantStatementsCapTheAsk: the generated statements, called
// directly as an application may, take a partial grant's ask above the
// capacity as the capacity, also for what penalty charges: an ask of the
// largest int64 neither overflows nor drives the count to the largest
// bigint (or the bucket to its deepest debt). Each algorithm, with and
// without penalty; the queue statements run the same functions.
func TestPartialGrantStatementsCapTheAsk(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	q := gen.New()
	at := base
	hourUs := time.Hour.Microseconds()
	for _, penalty := range []bool{false, true} {
		for _, n := range []int64{11, 1 << 53, math.MaxInt64} {
			key := []byte(fmt.Sprintf("%v/%d", penalty, n))
			for i, want := range []int64{10, 0} {
				what := fmt.Sprintf("penalty=%v, ask %d, check %d", penalty, n, i)
				counted := int64(10) // 10 granted, or charged under penalty
				if penalty && i == 1 {
					counted = 20
				}
				fw, err := q.FixedWindowTakeUpTo(ctx, pool, gen.FixedWindowTakeUpToParams{
					Key: key, N: n, MaxCount: 10, WindowUs: hourUs, Penalty: penalty, At: &at})
				require.NoError(t, err, what)
				require.Equal(t, want, fw.Granted, "fixed window: %s", what)
				require.Equal(t, counted, fw.Count, "fixed window: %s", what)

				sw, err := q.SlidingWindowTakeUpTo(ctx, pool, gen.SlidingWindowTakeUpToParams{
					Key: key, N: n, MaxCount: 10, WindowUs: hourUs, Penalty: penalty, At: &at})
				require.NoError(t, err, what)
				require.Equal(t, want, sw.Granted, "sliding window: %s", what)
				require.Equal(t, counted, sw.Count, "sliding window: %s", what)

				tb, err := q.TokenBucketTakeUpTo(ctx, pool, gen.TokenBucketTakeUpToParams{
					Key: key, N: n, Capacity: 10, RefillPerUs: 10 / float64(hourUs), Penalty: penalty, At: &at})
				require.NoError(t, err, what)
				require.Equal(t, want, tb.Granted, "token bucket: %s", what)
				require.Equal(t, float64(10-counted), math.Float64frombits(uint64(tb.TokensBits)), "token bucket: %s", what)
			}
		}
	}
}

// TestFallbackDeniesACostAboveItsLimit: with FallbackLimit below Limit (as
// its doc recommends: Limit divided by the instances), a check the limiter
// accepts but the memory tier can never admit is a denial from the memory
// tier during an outage, not ErrCostExceedsLimit: a valid request gets an
// answer from the failure policy. Single checks and AllowAll alike.
func TestFallbackDeniesACostAboveItsLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dead := testkit.DeadPool(t)
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			what := fmt.Sprintf("%s/penalty=%v", alg, penalty)
			l := testkit.NewLimiter(t, dead, ratelimit.Config{Name: "fb-" + what, Algorithm: alg, Limit: 10, FallbackLimit: 5, Window: time.Hour, Penalty: penalty}, ratelimit.DatabaseOptions{Timeout: 200 * time.Millisecond, BreakerCooldown: time.Second, Logger: quiet, Now: testkit.Pinned(base)})
			d, err := l.Allow(ctx, "k", ratelimit.Cost(8))
			require.NoError(t, err, what)
			require.False(t, d.Allowed, what)
			require.Zero(t, d.Granted, what)
			require.Equal(t, ratelimit.StoreMemory, d.Store, what)
			require.Equal(t, time.Second, d.RetryAfter, "%s: retry when the database may be back", what)
			m, err := ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: l, Key: "k", Cost: 8})
			require.NoError(t, err, what)
			require.False(t, m.Allowed, what)
			d, err = l.Allow(ctx, "k", ratelimit.Cost(5))
			require.NoError(t, err, what)
			require.True(t, d.Allowed, "%s: nothing was counted for the costs it could not admit", what)
			require.Equal(t, int64(5), d.Granted, what)
			_, err = l.Allow(ctx, "k", ratelimit.Cost(11))
			require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit, "%s: above the limit itself, still refused", what)
		}
	}
}
