package ratelimit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
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

// setPolicy writes a pgrl_policy row by plain SQL, as a DBA would.
func setPolicy(t *testing.T, pool *pgxpool.Pool, name string, alg ratelimit.Algorithm, limit int64, window time.Duration, burst int64, penalty bool) {
	t.Helper()
	var b *int64
	if burst > 0 {
		b = &burst
	}
	_, err := pool.Exec(context.Background(), `
INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst, penalty)
VALUES ($1, $2, $3, $4 * interval '1 microsecond', $5, $6)
ON CONFLICT (name) DO UPDATE SET algorithm = excluded.algorithm, "limit" = excluded."limit",
       "window" = excluded."window", burst = excluded.burst, penalty = excluded.penalty`,
		name, string(alg), limit, window.Microseconds(), b, penalty)
	require.NoError(t, err)
}

// setOverride writes (limit > 0) or deletes (limit 0) the override of key
// under policy name by plain SQL.
func setOverride(t *testing.T, pool *pgxpool.Pool, name, key string, limit, burst int64, window time.Duration, expires *time.Time) {
	t.Helper()
	ctx := context.Background()
	sk := ratelimit.StoredKey(ratelimit.HashedKeys, name, key)
	if limit == 0 && burst == 0 && window == 0 {
		_, err := pool.Exec(ctx, `DELETE FROM pgrl_policy_override WHERE policy = $1 AND key = $2`, name, sk)
		require.NoError(t, err)
		return
	}
	nullable := func(v int64) *int64 {
		if v == 0 {
			return nil
		}
		return &v
	}
	_, err := pool.Exec(ctx, `
INSERT INTO pgrl_policy_override (policy, key, "limit", burst, "window", expires_at)
VALUES ($1, $2, $3, $4, $5 * interval '1 microsecond', $6)
ON CONFLICT (policy, key) DO UPDATE SET "limit" = excluded."limit", burst = excluded.burst,
       "window" = excluded."window", expires_at = excluded.expires_at`,
		name, sk, nullable(limit), nullable(burst), nullable(window.Microseconds()), expires)
	require.NoError(t, err)
}

// A limiter reading its figures from a stored policy decides exactly as a
// limiter given the same figures with the check: a random run of checks
// with plain-SQL changes of the policy's limit (and burst) and of a key's
// override in between, for every algorithm, with and without penalty.
// Every check obeys the figures stored when it ran.
func TestPolicyStatementMatchesGivenRate(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(uint64(len(alg)), uint64(b2i(penalty))))
				c := testkit.NewClock(base)
				name := fmt.Sprintf("stmt-%s-%v", alg, penalty)
				setPolicy(t, pool, name, alg, 5, time.Minute, 0, penalty)
				stored := testkit.NewLimiter(t, pool, ratelimit.Config{
					Name: name, Policy: name, Algorithm: alg, Limit: 5, Window: time.Minute, Penalty: penalty, DenyCacheSize: -1,
				}, ratelimit.DatabaseOptions{Now: c.Now})
				given := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "given-" + name, Algorithm: alg, Limit: 5, Window: time.Minute, Penalty: penalty, DenyCacheSize: -1}, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
				policyRate := ratelimit.Rate{Limit: 5, Window: time.Minute}
				var vip *ratelimit.Rate // the override of key "vip"
				for step := range 300 {
					switch rng.IntN(10) {
					case 0:
						policyRate.Limit = 1 + rng.Int64N(8)
						policyRate.Burst = 0
						if alg == ratelimit.TokenBucket && rng.IntN(2) == 0 {
							policyRate.Burst = 1 + rng.Int64N(10)
						}
						setPolicy(t, pool, name, alg, policyRate.Limit, time.Minute, policyRate.Burst, penalty)
					case 1:
						if rng.IntN(3) == 0 {
							vip = nil
							setOverride(t, pool, name, "vip", 0, 0, 0, nil)
						} else {
							r := ratelimit.Rate{Limit: 1 + rng.Int64N(12), Window: time.Minute}
							if alg == ratelimit.TokenBucket && rng.IntN(2) == 0 {
								r.Window = time.Duration(1+rng.IntN(3)) * 30 * time.Second // one bucket, any rate
							}
							setOverride(t, pool, name, "vip", r.Limit, 0, r.Window, nil)
							vip = &r
						}
					}
					c.Add(time.Duration(rng.Int64N(int64(20 * time.Second))))
					key := []string{"a", "b", "vip"}[rng.IntN(3)]
					rate := policyRate
					if key == "vip" && vip != nil {
						rate = *vip
						if policyRate.Burst != 0 {
							rate.Burst = policyRate.Burst // the override sets the limit only
						}
					}
					if rate.Burst == 0 {
						rate.Burst = rate.Limit
					}
					n := 1 + rng.Int64N(min(rate.Burst, 3))
					got, err := stored.Allow(ctx, key, ratelimit.Cost(n))
					require.NoError(t, err, "step %d", step)
					want, err := given.Allow(ctx, key, ratelimit.Cost(n), ratelimit.AtRate(rate))
					require.NoError(t, err, "step %d", step)
					require.Equal(t, want, got, "step %d: %d of key %q at %+v", step, n, key, rate)
				}
			})
		}
	}
}

// A check whose stored policy moved the key's counter row elsewhere (a
// deleted policy, another algorithm, key mode or window) counts nothing
// and says so; no failure policy answers it. An expired override no longer
// applies, and a token-bucket override the policy cannot hold is ignored.
func TestPolicyStatementChanges(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	setPolicy(t, pool, "moved", ratelimit.FixedWindow, 3, time.Minute, 0, false)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "moved", Policy: "moved", Limit: 3, Window: time.Minute, OnFailure: ratelimit.FailOpen}, ratelimit.DatabaseOptions{Now: c.Now})
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)

	used := func() int64 {
		t.Helper()
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		return p.Used
	}
	changed := func(why string) {
		t.Helper()
		before := used()
		d, err := l.Allow(ctx, "k")
		require.ErrorIs(t, err, ratelimit.ErrPolicyChanged, why)
		require.ErrorContains(t, err, "build the limiter again", why)
		require.Equal(t, ratelimit.Decision{}, d, "%s: no failure policy answers", why)
		require.Equal(t, before, used(), "%s: nothing counted", why)
	}
	setPolicy(t, pool, "moved", ratelimit.FixedWindow, 3, 2*time.Minute, 0, false)
	changed("window")
	setPolicy(t, pool, "moved", ratelimit.SlidingWindow, 3, time.Minute, 0, false)
	changed("algorithm")
	setPolicy(t, pool, "moved", ratelimit.FixedWindow, 3, time.Minute, 0, false)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET key_mode = 'readable' WHERE name = 'moved'`)
	require.NoError(t, err)
	changed("key mode")
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET key_mode = 'hashed' WHERE name = 'moved'`)
	require.NoError(t, err)
	// An override with another window moves the key's row; other keys
	// keep theirs.
	setOverride(t, pool, "moved", "k", 0, 0, time.Hour, nil)
	changed("override window")
	d, err = l.Allow(ctx, "other")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	// An override that expired no longer applies.
	past := base.Add(-time.Second)
	setOverride(t, pool, "moved", "k", 0, 0, time.Hour, &past)
	d, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(2), d.Used)
	_, err = pool.Exec(ctx, `DELETE FROM pgrl_policy WHERE name = 'moved'`)
	require.NoError(t, err)
	changed("deleted")

	// A token bucket of 1 per hour cannot hold a burst of 2^53 tokens: the
	// override is ignored and the policy applies.
	setPolicy(t, pool, "tb", ratelimit.TokenBucket, 1, time.Hour, 0, false)
	setOverride(t, pool, "tb", "big", 0, ratelimit.MaxTokens, 0, nil)
	tb := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tb", Policy: "tb", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Hour}, ratelimit.DatabaseOptions{Now: c.Now})
	d, err = tb.Allow(ctx, "big")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(1), d.Limit)
	d, err = tb.Allow(ctx, "big")
	require.NoError(t, err)
	require.False(t, d.Allowed)
}

// A stored policy is read by single-row checks, under a valid name.
func TestPolicyConfigRefused(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	for _, cfg := range []struct {
		cfg  ratelimit.Config
		want error
		text string
	}{
		{ratelimit.Config{Name: "a", Policy: "a", Limit: 4, Window: time.Minute, Spread: 2}, ratelimit.ErrInvalidOption, "use Spread 1"},
		{ratelimit.Config{Name: "a", Policy: " a", Limit: 4, Window: time.Minute}, ratelimit.ErrInvalidName, "a policy name is"},
		{ratelimit.Config{Name: "a", Policy: string(make([]byte, 129)), Limit: 4, Window: time.Minute}, ratelimit.ErrInvalidName, "a policy name is"},
	} {
		_, err := testkit.New(pool, cfg.cfg)
		require.ErrorIs(t, err, cfg.want)
		require.ErrorContains(t, err, cfg.text)
	}
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// Coalesced checks of a limiter with a stored policy read it in their
// batch's statement: batches of checks of three keys (each key once, which
// the set-based statement decides, or one key several times, which the
// check queue does; the "vip" key under an override) decide exactly as the same
// checks made one by one at the figures stored when the batch ran, with
// the policy and the override changed by plain SQL between batches, for
// every algorithm.
func TestPolicyBatchMatchesGivenRate(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(uint64(len(alg))+7, uint64(b2i(penalty))))
				c := testkit.NewClock(base)
				name := fmt.Sprintf("batch-%s-%v", alg, penalty)
				setPolicy(t, pool, name, alg, 5, time.Minute, 0, penalty)
				stored := testkit.NewLimiter(t, pool, ratelimit.Config{
					Name: name, Policy: name, Algorithm: alg, Limit: 5, Window: time.Minute, Penalty: penalty, DenyCacheSize: -1,
				}, ratelimit.DatabaseOptions{Now: c.Now})
				require.True(t, ratelimit.Coalesces(stored), "a limiter with a stored policy coalesces")
				given := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "given-" + name, Algorithm: alg, Limit: 5, Window: time.Minute, Penalty: penalty, DenyCacheSize: -1}, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
				policyRate := ratelimit.Rate{Limit: 5, Window: time.Minute}
				var vip *ratelimit.Rate
				for step := range 120 {
					switch rng.IntN(6) {
					case 0:
						policyRate.Limit = 2 + rng.Int64N(8)
						setPolicy(t, pool, name, alg, policyRate.Limit, time.Minute, 0, penalty)
					case 1:
						if rng.IntN(3) == 0 {
							vip = nil
							setOverride(t, pool, name, "vip", 0, 0, 0, nil)
						} else {
							r := ratelimit.Rate{Limit: 2 + rng.Int64N(12), Window: time.Minute}
							if alg == ratelimit.TokenBucket && rng.IntN(2) == 0 {
								r.Window = time.Duration(1+rng.IntN(3)) * 30 * time.Second
							}
							setOverride(t, pool, name, "vip", r.Limit, 0, r.Window, nil)
							vip = &r
						}
					}
					c.Add(time.Duration(rng.Int64N(int64(20 * time.Second))))
					rateOf := func(key string) ratelimit.Rate {
						if key == "vip" && vip != nil {
							return *vip
						}
						return policyRate
					}
					var keys []string
					if rng.IntN(2) == 0 {
						keys = []string{"a", "b", "vip"}
						rng.Shuffle(3, func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
						keys = keys[:2+rng.IntN(2)]
					} else {
						for range 2 + rng.IntN(6) {
							keys = append(keys, []string{"a", "b", "vip"}[rng.IntN(3)])
						}
					}
					costs := make([]int64, len(keys))
					for i := range costs {
						costs[i] = 1 + rng.Int64N(2)
					}
					got, errs := ratelimit.SendBatch(ctx, stored, keys, costs)
					for i, key := range keys {
						require.NoError(t, errs[i], "step %d, check %d", step, i)
						want, err := given.Allow(ctx, key, ratelimit.Cost(costs[i]), ratelimit.AtRate(rateOf(key)))
						require.NoError(t, err, "step %d", step)
						require.Equal(t, want, got[i], "step %d, check %d: %d of key %q at %+v", step, i, costs[i], key, rateOf(key))
					}
				}
			})
		}
	}
}

// A batch with a check whose stored policy no longer matches its limiter
// decides nothing at first: every check is then decided on its own, so
// that the changed one gets ErrPolicyChanged, counting nothing, and the
// others their decisions, each counted once.
func TestPolicyBatchWithAChangedPolicy(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		name := "batch-moved-" + string(alg)
		setPolicy(t, pool, name, alg, 10, time.Minute, 0, false)
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Policy: name, Algorithm: alg, Limit: 10, Window: time.Minute, OnFailure: ratelimit.FailOpen, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: c.Now})
		used := func(key string) int64 {
			t.Helper()
			p, err := l.Peek(ctx, key)
			require.NoError(t, err)
			return p.Used
		}
		_, errs := ratelimit.SendBatch(ctx, l, []string{"k", "other", "k"}, []int64{1, 1, 1})
		require.Equal(t, []error{nil, nil, nil}, errs, alg)
		require.Equal(t, int64(2), used("k"), alg)
		if alg == ratelimit.TokenBucket {
			// A bucket has no window to move: change its algorithm.
			setPolicy(t, pool, name, ratelimit.FixedWindow, 10, time.Minute, 0, false)
		} else {
			setOverride(t, pool, name, "k", 0, 0, time.Hour, nil)
		}
		ds, errs := ratelimit.SendBatch(ctx, l, []string{"other", "k", "other", "k"}, []int64{1, 1, 2, 1})
		if alg == ratelimit.TokenBucket {
			for i, err := range errs {
				require.ErrorIs(t, err, ratelimit.ErrPolicyChanged, "%s check %d", alg, i)
			}
			continue
		}
		// Each key once: the set-based statement decides the others, and
		// leaves the changed key out.
		one, oneErrs := ratelimit.SendBatch(ctx, l, []string{"k", "third"}, []int64{1, 3})
		require.ErrorIs(t, oneErrs[0], ratelimit.ErrPolicyChanged, alg)
		require.NoError(t, oneErrs[1], alg)
		require.True(t, one[1].Allowed, alg)
		require.Equal(t, int64(3), one[1].Used, "%s: counted once", alg)
		require.ErrorIs(t, errs[1], ratelimit.ErrPolicyChanged, alg)
		require.ErrorIs(t, errs[3], ratelimit.ErrPolicyChanged, alg)
		require.NoError(t, errs[0], alg)
		require.NoError(t, errs[2], alg)
		require.True(t, ds[0].Allowed && ds[2].Allowed, alg)
		require.Equal(t, []int64{2, 4}, []int64{ds[0].Used, ds[2].Used}, "%s: each counted once", alg)
		setOverride(t, pool, name, "k", 0, 0, 0, nil)
		require.Equal(t, int64(2), used("k"), "%s: the changed key counted nothing", alg)
	}
}

// Concurrent checks of one limiter with a stored policy share round trips,
// and admit exactly the stored limit, not the limiter's own: 16
// goroutines, 2 keys, one under an override. Every round is exact; on a
// busy machine a round may share no round trip (a statement that takes
// over 5 ms sends the queued checks out alone), so rounds of a new policy
// are run until one has, five at most.
func TestPolicyCoalescedExact(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		var batched uint64
		for round := 0; round < 5 && batched == 0; round++ {
			batched = policyCoalescedRound(t, pool, alg, fmt.Sprintf("coalesced-%s-%d", alg, round))
		}
		require.Positive(t, batched, "%s: checks shared round trips", alg)
	}
}

// policyCoalescedRound is one round of TestPolicyCoalescedExact, with the
// policy name: it returns how many checks shared a round trip.
func policyCoalescedRound(t *testing.T, pool *pgxpool.Pool, alg ratelimit.Algorithm, name string) uint64 {
	ctx := context.Background()
	setPolicy(t, pool, name, alg, 40, time.Hour, 0, false)
	setOverride(t, pool, name, "vip", 70, 0, 0, nil)
	// The limiter believes 1,000: the stored 40 (70 for "vip") decides.
	// One round trip at a time, so that checks queue and share one.
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Policy: name, Algorithm: alg, Limit: 1000, Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{MaxInFlight: 1, Timeout: time.Minute})
	var admitted [2]atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				k := (g + i) % 2
				d, err := l.Allow(ctx, []string{"plain", "vip"}[k])
				if err != nil {
					errs <- err
					return
				}
				if d.Store != ratelimit.StorePostgres {
					errs <- fmt.Errorf("decided by %v", d.Store)
					return
				}
				if d.Allowed {
					admitted[k].Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err, alg)
	}
	require.Equal(t, int64(40), admitted[0].Load(), alg)
	require.Equal(t, int64(70), admitted[1].Load(), alg)
	return ratelimit.BatchedChecks(l)
}

// counterPolicyLimit reads policy_limit of the counter row of key under
// name that alg last wrote: nil when the statement that reads the policy's
// row alone wrote it (it leaves the column as it is, unset on a new row),
// set when the statement that reads the key's override did.
func counterPolicyLimit(t *testing.T, pool *pgxpool.Pool, alg ratelimit.Algorithm, name, key string) *int64 {
	t.Helper()
	table := map[ratelimit.Algorithm]string{
		ratelimit.FixedWindow: "pgrl_fixed_window", ratelimit.SlidingWindow: "pgrl_sliding_window",
		ratelimit.TokenBucket: "pgrl_token_bucket",
	}[alg]
	var v *int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT policy_limit FROM `+table+` WHERE key = $1 ORDER BY updated_at DESC LIMIT 1`,
		ratelimit.StoredKey(ratelimit.HashedKeys, name, key)).Scan(&v))
	return v
}

// While the stored policy holds the limiter's figures and has no override,
// a check reads the policy's row alone (it leaves the counter row's
// policy_limit unset, which the statement reading overrides writes). An
// override written by plain SQL is obeyed by the very next check of its
// key all the same, and other keys go on reading the row alone; a changed
// limit is obeyed by the very next check too. Every check decides as a
// limiter given the figures stored when it ran.
func TestPolicyWithoutOverridesReadsThePolicyRowAlone(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		t.Run(string(alg), func(t *testing.T) {
			c := testkit.NewClock(base)
			name := "bare-" + string(alg)
			setPolicy(t, pool, name, alg, 3, time.Hour, 0, false)
			cfg := ratelimit.Config{Name: name, Policy: name, Algorithm: alg, Limit: 3, Window: time.Hour, DenyCacheSize: -1}
			stored := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			policyLimit := func(key string) *int64 { return counterPolicyLimit(t, pool, alg, name, key) }
			allow := func(key string, want bool, used int64) {
				t.Helper()
				d, err := stored.Allow(ctx, key)
				require.NoError(t, err)
				require.Equal(t, want, d.Allowed, "key %q", key)
				require.Equal(t, used, d.Used, "key %q", key)
			}
			allow("a", true, 1)
			allow("vip", true, 1)
			require.Nil(t, policyLimit("a"), "the policy row alone was read")

			// An override of another key: the very next check of "vip" obeys it.
			setOverride(t, pool, name, "vip", 1, 0, 0, nil)
			d, err := stored.Allow(ctx, "vip")
			require.NoError(t, err)
			require.Equal(t, int64(1), d.Limit, "the override applied")
			if alg != ratelimit.TokenBucket {
				require.False(t, d.Allowed, "one of the override's one used already")
			}
			allow("a", true, 2)
			require.Nil(t, policyLimit("a"), "a key without an override: still the policy row alone")
			setOverride(t, pool, name, "vip", 0, 0, 0, nil)
			d, err = stored.Allow(ctx, "vip")
			require.NoError(t, err)
			require.Equal(t, int64(3), d.Limit, "the override is gone")

			// A limiter built after the override is gone reads the row alone
			// again, and a raised limit is obeyed by its very next check.
			fresh := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			_, err = fresh.Allow(ctx, "b")
			require.NoError(t, err)
			require.Nil(t, policyLimit("b"), "the policy row alone was read")
			setPolicy(t, pool, name, alg, 4, time.Hour, 0, false)
			d, err = fresh.Allow(ctx, "a")
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, int64(4), d.Limit, "the limit stored when it ran")
		})
	}
}

// A policy with overrides: a check of a key without one reads the policy's
// row alone, guarded by the revision of the overrides' keys the limiter
// read (migration 000021), and whatever happens to the overrides by plain
// SQL, the very next check of every key obeys it: an override added to a
// key checked lean a moment before, one changed, one removed, an expired
// one, and the policy deleted and made again under its name with other
// overrides (its revision is new, although every figure is the same). A
// policy with more overrides than a limiter holds is read with the key's
// override in every check.
func TestPolicyOverridesOfOtherKeysLeaveTheRowAlone(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		t.Run(string(alg), func(t *testing.T) {
			c := testkit.NewClock(base)
			name := "others-" + string(alg)
			setPolicy(t, pool, name, alg, 3, time.Hour, 0, false)
			setOverride(t, pool, name, "vip", 1, 0, 0, nil)
			past := base.Add(-time.Minute)
			setOverride(t, pool, name, "lapsed", 1, 0, 0, &past)
			cfg := ratelimit.Config{Name: name, Policy: name, Algorithm: alg, Limit: 3, Window: time.Hour, DenyCacheSize: -1}
			l := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			// lean reports whether key's counter row was written by the
			// statement that reads the policy's row alone (check deletes
			// the key's rows first, so that a new row is written).
			lean := func(key string) bool { return counterPolicyLimit(t, pool, alg, name, key) == nil }
			check := func(key string, limit int64) {
				t.Helper()
				for _, table := range []string{"pgrl_fixed_window", "pgrl_sliding_window", "pgrl_token_bucket"} {
					_, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE key = $1`, ratelimit.StoredKey(ratelimit.HashedKeys, name, key))
					require.NoError(t, err)
				}
				d, err := l.Allow(ctx, key)
				require.NoError(t, err)
				require.Equal(t, ratelimit.StorePostgres, d.Store)
				require.True(t, d.Allowed, "key %q", key)
				require.Equal(t, limit, d.Limit, "key %q", key)
			}
			check("a", 3) // learns the overrides' keys
			check("b", 3)
			require.True(t, lean("b"), "a key without an override reads the policy's row alone")
			check("vip", 1)
			require.False(t, lean("vip"), "a key with an override reads it")
			check("lapsed", 3)
			require.False(t, lean("lapsed"), "an expired override is the statement's to judge")

			// Added to a key just checked lean: obeyed by its very next check.
			setOverride(t, pool, name, "b", 2, 0, 0, nil)
			check("b", 2)
			check("c", 3)
			require.True(t, lean("c"), "the keys read again")
			// An override's figures changed: obeyed; other keys stay lean.
			setOverride(t, pool, name, "vip", 2, 0, 0, nil)
			check("vip", 2)
			check("c", 3)
			require.True(t, lean("c"))
			// Removed: the key's own limit again.
			setOverride(t, pool, name, "b", 0, 0, 0, nil)
			check("b", 3)

			// The policy made again under its name, with the same figures
			// and an override of a key the limiter knew as without one.
			_, err := pool.Exec(ctx, `DELETE FROM pgrl_policy WHERE name = $1`, name)
			require.NoError(t, err)
			setPolicy(t, pool, name, alg, 3, time.Hour, 0, false)
			setOverride(t, pool, name, "c", 1, 0, 0, nil)
			check("c", 1)
			check("d", 3)
			require.True(t, lean("d"))

			// More overrides than a limiter holds: every check reads its
			// key's override.
			_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit")
SELECT $1, pgrl_policy_key($1, 'many-' || i), 1 FROM generate_series(1, 10001) AS i`, name)
			require.NoError(t, err)
			crowded := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			for _, key := range []string{"e", "f", "g"} {
				d, err := crowded.Allow(ctx, key)
				require.NoError(t, err)
				require.Equal(t, int64(3), d.Limit)
				require.False(t, lean(key), "key %q", key)
			}
			d, err := crowded.Allow(ctx, "many-7")
			require.NoError(t, err)
			require.Equal(t, int64(1), d.Limit)
		})
	}
}

// A check in the caller's transaction (AllowTx) that finds the policy's
// overrides changed reads their keys on the Database's pool, not in the
// transaction: the transaction goes on as the caller left it, and the
// limiter's next check of a key without an override reads the row alone.
func TestPolicyOverrideKeysReadOutsideTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	name := "in-tx"
	setPolicy(t, pool, name, ratelimit.FixedWindow, 3, time.Hour, 0, false)
	setOverride(t, pool, name, "vip", 1, 0, 0, nil)
	cfg := ratelimit.Config{Name: name, Policy: name, Limit: 3, Window: time.Hour, DenyCacheSize: -1}
	l := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true})

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var backend, inTx int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend))
	d, err := l.AllowTx(ctx, tx, "a")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&inTx), "the transaction is usable")
	require.Equal(t, backend, inTx)
	require.NoError(t, tx.Commit(ctx))

	d, err = l.Allow(ctx, "b")
	require.NoError(t, err)
	require.Equal(t, int64(3), d.Limit)
	require.Nil(t, counterPolicyLimit(t, pool, ratelimit.FixedWindow, name, "b"), "the keys were read: the row alone")
	d, err = l.Allow(ctx, "vip")
	require.NoError(t, err)
	require.Equal(t, int64(1), d.Limit)
}

// The limiters one Database makes for a stored policy share what they know
// of its overrides: a limiter made after another has read them (package
// policy makes one whenever its policy changes) reads the policy's row
// alone from its first check. One whose figures the policy's row does not
// hold reads each key's override from then on, and the others go on as
// they were.
func TestPolicyOverrideKeysSharedByTheDatabasesLimiters(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.SlidingWindow, ratelimit.TokenBucket} {
		t.Run(string(alg), func(t *testing.T) {
			c := testkit.NewClock(base)
			name := "shared-" + string(alg)
			setPolicy(t, pool, name, alg, 3, time.Hour, 0, false)
			setOverride(t, pool, name, "vip", 1, 0, 0, nil)
			cfg := ratelimit.Config{Name: name, Policy: name, Algorithm: alg, Limit: 3, Window: time.Hour, DenyCacheSize: -1}
			rdb := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			check := func(l *ratelimit.Limiter, key string, limit int64) (lean bool) {
				t.Helper()
				d, err := l.Allow(ctx, key)
				require.NoError(t, err)
				require.Equal(t, ratelimit.StorePostgres, d.Store)
				require.True(t, d.Allowed, "key %q", key)
				require.Equal(t, limit, d.Limit, "key %q", key)
				return counterPolicyLimit(t, pool, alg, name, key) == nil
			}
			first := testkit.Limiter(t, rdb, cfg)
			require.False(t, check(first, "a", 3), "the first check learns the overrides' keys")
			require.True(t, check(first, "b", 3))

			second := testkit.Limiter(t, rdb, cfg)
			require.True(t, check(second, "c", 3), "a later limiter of the policy starts from what the first read")
			require.False(t, check(second, "vip", 1))

			// Figures the policy's row does not hold: its checks read the
			// policy and the key's override.
			stale := cfg
			stale.Limit = 4
			other := testkit.Limiter(t, rdb, stale)
			require.False(t, check(other, "d", 3))
			require.False(t, check(other, "e", 3), "a limiter whose figures the policy does not hold stays off the lean statement")
			require.True(t, check(first, "f", 3), "and the others stay on it")
			require.True(t, check(second, "g", 3))

			// Another Database knows nothing yet.
			apart := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{DisableCoalescing: true, Now: c.Now})
			require.False(t, check(apart, "h", 3))
			require.True(t, check(apart, "i", 3))
		})
	}
}
