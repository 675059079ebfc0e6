package ratelimit_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
					Shadow: true, Logger: quiet, Now: testkit.Pinned(base)}
			}
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
					c.DisableCoalescing, c.DenyCacheSize = true, deny
					obs := &recordingObserver{}
					c.Observer = obs
					l := testkit.NewLimiter(t, pool, c)
					exhaust(t, c.Name,
						func(n int64) (ratelimit.Decision, error) { return l.AllowN(ctx, "k", n) },
						func(n int64) (ratelimit.Decision, error) { return l.AllowUpTo(ctx, "k", n) })
					seen := obs.seen()
					require.Len(t, seen, 6)
					for _, d := range seen[1:] {
						requireShadowDenied(t, d, c.Name+": observed")
					}
				}
			})
			t.Run("coalesced", func(t *testing.T) {
				// Concurrent checks of one key share queue statements; the
				// grants add up to the limit exactly.
				l := testkit.NewLimiter(t, pool, cfg("coalesced"))
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
								d, err = l.AllowN(ctx, "k", 1)
							} else {
								d, err = l.AllowUpTo(ctx, "k", 3)
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
				l := testkit.NewLimiter(t, pool, cfg("tx"))
				tx, err := pool.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				exhaust(t, "tx",
					func(n int64) (ratelimit.Decision, error) { return l.AllowNTx(ctx, tx, "k", n) },
					func(n int64) (ratelimit.Decision, error) { return l.AllowUpToTx(ctx, tx, "k", n) })
			})
			t.Run("allow-all", func(t *testing.T) {
				obs := &recordingObserver{}
				c := cfg("all")
				c.Observer = obs
				shadow := testkit.NewLimiter(t, pool, c)
				other := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "all-other-" + string(alg), Algorithm: alg,
					Limit: 100, Window: time.Hour, Now: testkit.Pinned(base)})
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
				for _, d := range obs.seen() {
					if d.ShadowDenied {
						require.Zero(t, d.Granted, "observed")
					}
				}
			})
			t.Run("policy", func(t *testing.T) {
				c := cfg("pol")
				c.Policy = c.Name
				setPolicy(t, pool, c.Policy, alg, 5, time.Hour, 0, false)
				l := testkit.NewLimiter(t, pool, c)
				exhaust(t, "policy",
					func(n int64) (ratelimit.Decision, error) { return l.AllowN(ctx, "k", n) },
					func(n int64) (ratelimit.Decision, error) { return l.AllowUpTo(ctx, "k", n) })
			})
			t.Run("memory", func(t *testing.T) {
				obs := &recordingObserver{}
				c := cfg("mem")
				c.Observer = obs
				m, err := ratelimit.NewMemory(c, ratelimit.MemoryOptions{})
				require.NoError(t, err)
				exhaust(t, "memory",
					func(n int64) (ratelimit.Decision, error) { return m.AllowN(ctx, "k", n) },
					func(n int64) (ratelimit.Decision, error) { return m.AllowUpTo(ctx, "k", n) })
				seen := obs.seen()
				require.Len(t, seen, 6)
				for _, d := range seen[1:] {
					requireShadowDenied(t, d, "memory: observed")
				}
			})
			t.Run("failure-policy", func(t *testing.T) {
				dead := testkit.DeadPool(t)
				c := cfg("dead-memory")
				c.Timeout = 200 * time.Millisecond
				c.OnFailure = ratelimit.FailToMemory
				l := testkit.NewLimiter(t, dead, c)
				exhaust(t, "fail to memory",
					func(n int64) (ratelimit.Decision, error) { return l.AllowN(ctx, "k", n) },
					func(n int64) (ratelimit.Decision, error) { return l.AllowUpTo(ctx, "k", n) })
				c = cfg("dead-closed")
				c.Timeout = 200 * time.Millisecond
				c.OnFailure = ratelimit.FailClosed
				l = testkit.NewLimiter(t, dead, c)
				for _, upTo := range []bool{false, true} {
					check := l.AllowN
					if upTo {
						check = l.AllowUpTo
					}
					d, err := check(ctx, "k", 2)
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
