package ratelimit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

func newMemory(t testing.TB, cfg ratelimit.Config, opts ratelimit.MemoryOptions) *ratelimit.MemoryLimiter {
	t.Helper()
	m, err := ratelimit.NewMemory(cfg, opts)
	require.NoError(t, err)
	return m
}

// memStep is one check in a sequence: at an offset from base, cost n
// (0 means a Peek), with the expected outcome.
type memStep struct {
	at        time.Duration
	n         int64
	allowed   bool
	remaining int64
	retry     time.Duration // checked when denied
	resetAt   time.Duration // offset from base; checked when non-zero
}

func runSteps(t *testing.T, cfg ratelimit.Config, steps []memStep) {
	t.Helper()
	ctx := context.Background()
	c := testkit.NewClock(time.Time{})
	m := newMemory(t, cfg, ratelimit.MemoryOptions{Now: c.Now})
	for i, s := range steps {
		c.Set(base.Add(s.at))
		var d ratelimit.Decision
		var err error
		if s.n == 0 {
			d, err = m.Peek(ctx, "k")
		} else {
			d, err = m.Allow(ctx, "k", ratelimit.Cost(s.n))
		}
		require.NoError(t, err)
		msg := fmt.Sprintf("step %d: %+v", i, s)
		require.Equal(t, s.allowed, d.Allowed, msg)
		require.Equal(t, s.remaining, d.Remaining, msg)
		require.Equal(t, ratelimit.StoreMemory, d.Store, msg)
		require.True(t, d.Now.Equal(base.Add(s.at)), msg)
		if s.allowed {
			require.Zero(t, d.RetryAfter, msg)
		} else {
			require.Equal(t, s.retry, d.RetryAfter, msg)
		}
		if s.resetAt != 0 {
			require.Equal(t, base.Add(s.resetAt), d.ResetAt.UTC(), msg)
		}
	}
}

// TestMemorySequences replays hand-computed sequences; they are the same
// as the Postgres limiter's tests where those exist.
func TestMemorySequences(t *testing.T) {
	t.Parallel()
	s := time.Second
	ms := time.Millisecond
	fw := ratelimit.Config{Name: "fw", Limit: 3, Window: time.Minute}
	fwp := fw
	fwp.Penalty = true
	tb := ratelimit.Config{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Second, Burst: 5}
	tbp := ratelimit.Config{Name: "tbp", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Second, Burst: 2, Penalty: true}
	sw := ratelimit.Config{Name: "sw", Algorithm: ratelimit.SlidingWindow, Limit: 10, Window: time.Minute}
	swp := sw
	swp.Penalty = true
	for _, tc := range []struct {
		name  string
		cfg   ratelimit.Config
		steps []memStep
	}{
		{"fixed", fw, []memStep{
			{at: 10 * s, n: 1, allowed: true, remaining: 2, resetAt: time.Minute},
			{at: 10 * s, n: 1, allowed: true, remaining: 1, resetAt: time.Minute},
			{at: 10 * s, n: 1, allowed: true, remaining: 0, resetAt: time.Minute},
			{at: 10 * s, n: 1, allowed: false, remaining: 0, retry: 50 * s, resetAt: time.Minute},
			{at: 20 * s, n: 0, allowed: false, remaining: 0, retry: 40 * s},
			// The next window starts afresh, aligned on the minute.
			{at: time.Minute, n: 3, allowed: true, remaining: 0, resetAt: 2 * time.Minute},
			{at: 2*time.Minute - time.Microsecond, n: 1, allowed: false, retry: time.Microsecond},
			{at: 2 * time.Minute, n: 0, allowed: true, remaining: 3, resetAt: 3 * time.Minute},
		}},
		{"fixed penalty", fwp, []memStep{
			{at: 0, n: 2, allowed: true, remaining: 1},
			{at: s, n: 2, allowed: false, remaining: 0, retry: 59 * s}, // counted: 4
			{at: 2 * s, n: 1, allowed: false, remaining: 0, retry: 58 * s},
			{at: time.Minute, n: 3, allowed: true, remaining: 0},
		}},
		{"fixed without penalty", fw, []memStep{
			{at: 0, n: 2, allowed: true, remaining: 1},
			{at: s, n: 2, allowed: false, remaining: 1, retry: 59 * s}, // not counted
			{at: 2 * s, n: 1, allowed: true, remaining: 0},
		}},
		{"token bucket", tb, []memStep{
			{at: 0, n: 5, allowed: true, remaining: 0, resetAt: 500 * ms},
			{at: 0, n: 1, allowed: false, remaining: 0, retry: 100 * ms},
			{at: 250 * ms, n: 2, allowed: true, remaining: 0, resetAt: 700 * ms}, // 0.5 left
			{at: 250 * ms, n: 1, allowed: false, remaining: 0, retry: 50 * ms},
			{at: 250 * ms, n: 3, allowed: false, remaining: 0, retry: 250 * ms},
			{at: 350 * ms, n: 0, allowed: true, remaining: 1, resetAt: 700 * ms},
			{at: time.Hour, n: 0, allowed: true, remaining: 5, resetAt: time.Hour},
		}},
		{"token bucket penalty", tbp, []memStep{
			{at: 0, n: 1, allowed: true, remaining: 1},
			{at: 0, n: 1, allowed: true, remaining: 0},
			{at: 0, n: 1, allowed: false, retry: 2 * s},             // -1
			{at: 0, n: 1, allowed: false, retry: 3 * s},             // -2
			{at: 0, n: 1, allowed: false, retry: 3 * s},             // stays at -2
			{at: 0, n: 2, allowed: false, retry: 4 * s},             // still -2
			{at: 2500 * ms, n: 1, allowed: false, retry: 1500 * ms}, // 0.5, charged: -0.5
			{at: 4 * s, n: 1, allowed: true, remaining: 0},
		}},
		{"sliding window", sw, []memStep{
			{at: 30 * s, n: 10, allowed: true, remaining: 0, resetAt: 2 * time.Minute},
			// A quarter into the next window the previous one weighs 3/4:
			// estimate 7.5, so 2 more fit and 3 do not until 18 s in.
			{at: time.Minute + 15*s, n: 3, allowed: false, remaining: 2, retry: 3 * s},
			{at: time.Minute + 15*s, n: 0, allowed: true, remaining: 2},
			{at: time.Minute + 15*s, n: 2, allowed: true, remaining: 0, resetAt: 3 * time.Minute}, // 9.5
			// Two windows later everything is forgotten.
			{at: 3*time.Minute + s, n: 10, allowed: true, remaining: 0},
		}},
		{"sliding window penalty", swp, []memStep{
			{at: 30 * s, n: 10, allowed: true, remaining: 0},
			{at: 40 * s, n: 5, allowed: false, remaining: 0, retry: 60 * s}, // counted: 15
			// 15 weighs 11.25 a quarter into the next window: denied, and
			// counted (12.25). A check of 1 fits once 15*(w-x)/w + 1 + 1 <= 10,
			// at x = 28 s.
			{at: time.Minute + 15*s, n: 1, allowed: false, remaining: 0, retry: 13 * s},
			{at: time.Minute + 20*s, n: 0, allowed: false, remaining: 0, retry: 8 * s},
			{at: time.Minute + 28*s, n: 1, allowed: true, remaining: 0}, // 8 + 2
		}},
		{"sliding window without penalty", sw, []memStep{
			{at: 30 * s, n: 10, allowed: true, remaining: 0},
			{at: 40 * s, n: 5, allowed: false, remaining: 0, retry: 50 * s}, // not counted: 5 fit 30 s into the next window
			{at: time.Minute + 15*s, n: 1, allowed: true, remaining: 1},     // 7.5 + 1
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			runSteps(t, tc.cfg, tc.steps)
		})
	}
}

// TestMemoryMatchesModel checks random sequences against the reference
// model of the SQL semantics (model_test.go), for every algorithm with and
// without penalty.
func TestMemoryMatchesModel(t *testing.T) {
	t.Parallel()
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				t.Parallel()
				rng := rand.New(rand.NewPCG(7, uint64(len(alg))))
				c := testkit.NewClock(base.Add(123456 * time.Microsecond))
				cfg := ratelimit.Config{Name: "model", Algorithm: alg, Limit: 7, Window: 2 * time.Second, Burst: 9, Penalty: penalty}
				if alg != ratelimit.TokenBucket {
					cfg.Burst = 0
				}
				m := newMemory(t, cfg, ratelimit.MemoryOptions{Now: c.Now})
				ref := newModel(cfg)
				capacity := cfg.Limit
				if alg == ratelimit.TokenBucket {
					capacity = cfg.Burst
				}
				for i := range 5000 {
					c.Set(c.Now().Add(time.Duration(rng.Int64N(700_000)) * time.Microsecond))
					key := strconv.Itoa(rng.IntN(3))
					n := 1 + rng.Int64N(capacity)
					if rng.IntN(3) > 0 {
						n = 1
					}
					d, err := m.Allow(context.Background(), key, ratelimit.Cost(n))
					require.NoError(t, err)
					allowed, remaining := ref.take(key, n, c.Now().UnixMicro())
					require.Equal(t, allowed, d.Allowed, "check %d", i)
					require.Equal(t, remaining, d.Remaining, "check %d", i)
				}
			})
		}
	}
}

func TestMemoryBadInputs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := ratelimit.NewMemory(ratelimit.Config{Name: "x", Limit: 0, Window: time.Second}, ratelimit.MemoryOptions{})
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit)
	_, err = ratelimit.NewMemory(ratelimit.Config{Name: "x", Limit: 1}, ratelimit.MemoryOptions{})
	require.ErrorIs(t, err, ratelimit.ErrInvalidWindow)
	_, err = ratelimit.NewMemory(ratelimit.Config{Limit: 1, Window: time.Second}, ratelimit.MemoryOptions{})
	require.ErrorIs(t, err, ratelimit.ErrInvalidName)

	for _, alg := range ratelimit.Algorithms {
		m := newMemory(t, ratelimit.Config{Name: "x", Algorithm: alg, Limit: 3, Window: time.Minute}, ratelimit.MemoryOptions{})
		_, err = m.Allow(ctx, "k", ratelimit.Cost(0))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
		_, err = m.Allow(ctx, "k", ratelimit.Cost(-1))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
		_, err = m.Allow(ctx, "k", ratelimit.Cost(4))
		require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
		require.Zero(t, m.Len(), "a bad check stores nothing")
		d, err := m.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(3), d.Remaining)
	}
}

func TestMemoryResetPeekAndKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testkit.NewClock(base)
	m := newMemory(t, ratelimit.Config{Name: "r", Limit: 2, Window: time.Minute}, ratelimit.MemoryOptions{Now: c.Now})

	// Any bytes are a key; long keys that differ only at the end stay
	// apart, and a short key never meets a long key's stored form.
	long := strings.Repeat("x", 1<<20)
	keys := []string{"", "\x00", "\xff\xfe", long + "a", long + "b", strings.Repeat("y", 64), strings.Repeat("y", 65)}
	for _, k := range keys {
		d, err := m.Allow(ctx, k, ratelimit.Cost(2))
		require.NoError(t, err)
		require.True(t, d.Allowed, "%.10q", k)
	}
	require.Equal(t, len(keys), m.Len())
	for _, k := range keys {
		d, err := m.Allow(ctx, k)
		require.NoError(t, err)
		require.False(t, d.Allowed, "%.10q", k)
	}

	// Peek counts nothing and stores nothing.
	p, err := m.Peek(ctx, "never")
	require.NoError(t, err)
	require.True(t, p.Allowed)
	require.Equal(t, int64(2), p.Remaining)
	require.Equal(t, len(keys), m.Len())

	require.NoError(t, m.Reset(ctx, long+"a"))
	require.NoError(t, m.Reset(ctx, "absent"))
	require.Equal(t, len(keys)-1, m.Len())
	d, err := m.Allow(ctx, long+"a")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	d, err = m.Allow(ctx, long+"b")
	require.NoError(t, err)
	require.False(t, d.Allowed)
}

// TestMemoryRealClock uses the limiter's own monotonic clock.
func TestMemoryRealClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := newMemory(t, ratelimit.Config{Name: "clock", Algorithm: ratelimit.TokenBucket, Limit: 1000, Window: time.Second, Burst: 2}, ratelimit.MemoryOptions{})
	before := time.Now()
	d, err := m.Allow(ctx, "k", ratelimit.Cost(2))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.WithinDuration(t, before, d.Now, time.Second)
	require.True(t, d.ResetAt.After(d.Now))
	d, err = m.Allow(ctx, "k")
	require.NoError(t, err)
	if !d.Allowed { // a token takes 1 ms to come back
		require.LessOrEqual(t, d.RetryAfter, time.Millisecond)
		time.Sleep(d.RetryAfter)
	}
	require.Eventually(t, func() bool {
		d, err := m.Allow(ctx, "k")
		return err == nil && d.Allowed
	}, time.Second, time.Millisecond)
	require.Equal(t, "clock", m.Config().Name)
	require.Equal(t, int64(2), m.Config().Burst)
}

// TestMemoryConcurrentOneKey: 64 goroutines hammering one key admit exactly
// the limit. Run with -race.
func TestMemoryConcurrentOneKey(t *testing.T) {
	t.Parallel()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			const limit, workers, tries = 500, 64, 20
			m := newMemory(t, ratelimit.Config{
				Name: "hot", Algorithm: alg, Limit: limit, Window: time.Hour,
			}, ratelimit.MemoryOptions{Now: func() time.Time { return base }})
			var admitted atomic.Int64
			var wg sync.WaitGroup
			for range workers {
				wg.Go(func() {
					for range tries {
						d, err := m.Allow(context.Background(), "one")
						if err != nil {
							panic(err)
						}
						if d.Allowed {
							admitted.Add(1)
						}
					}
				})
			}
			wg.Wait()
			require.Equal(t, int64(limit), admitted.Load())
		})
	}
}

// TestMemoryLRUBound inserts ten times MaxKeys keys: the limiter never holds
// more than MaxKeys, recent keys are remembered and the oldest forgotten.
func TestMemoryLRUBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const maxKeys = 1000
	m := newMemory(t, ratelimit.Config{Name: "lru", Limit: 1, Window: time.Hour},
		ratelimit.MemoryOptions{MaxKeys: maxKeys, Shards: 8, Now: func() time.Time { return base }})
	for i := range 10 * maxKeys {
		d, err := m.Allow(ctx, strconv.Itoa(i))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.LessOrEqual(t, m.Len(), maxKeys)
	}
	require.Greater(t, m.Len(), maxKeys*9/10, "shards fill up to their share")
	d, err := m.Allow(ctx, strconv.Itoa(10*maxKeys-1))
	require.NoError(t, err)
	require.False(t, d.Allowed, "the most recent key is remembered")
	d, err = m.Allow(ctx, "0")
	require.NoError(t, err)
	require.True(t, d.Allowed, "the least recent key was evicted and starts afresh")

	// Fewer keys than shards: the cap still holds.
	small := newMemory(t, ratelimit.Config{Name: "small", Limit: 1, Window: time.Hour}, ratelimit.MemoryOptions{MaxKeys: 3, Now: testkit.Pinned(base)})
	for i := range 100 {
		_, err := small.Allow(ctx, strconv.Itoa(i))
		require.NoError(t, err)
	}
	require.LessOrEqual(t, small.Len(), 3)
}

// TestMemoryLazySweep: once their state is dead, idle keys are dropped by
// later calls, without a background goroutine.
func TestMemoryLazySweep(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		alg         ratelimit.Algorithm
		alive, dead time.Duration // the idle keys' state is still live, then dead
	}{
		// The window ended.
		{ratelimit.FixedWindow, time.Minute - time.Microsecond, time.Minute},
		// Neither the current nor the previous window weighs any more.
		{ratelimit.SlidingWindow, 2*time.Minute - time.Microsecond, 2 * time.Minute},
		// The bucket refilled: 3 tokens at 10 per second.
		{ratelimit.TokenBucket, 299 * time.Millisecond, 301 * time.Millisecond},
	} {
		t.Run(string(tc.alg), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			c := testkit.NewClock(base)
			window := time.Minute
			if tc.alg == ratelimit.TokenBucket {
				window = time.Second
			}
			m := newMemory(t, ratelimit.Config{Name: "sweep", Algorithm: tc.alg, Limit: 10, Window: window, Burst: 3},
				ratelimit.MemoryOptions{Shards: 1, Now: c.Now})
			for i := range 100 {
				_, err := m.Allow(ctx, strconv.Itoa(i), ratelimit.Cost(3))
				require.NoError(t, err)
			}
			require.Equal(t, 100, m.Len())

			// Just before death nothing is swept.
			c.Set(base.Add(tc.alive))
			for range 10 {
				_, err := m.Peek(ctx, "other")
				require.NoError(t, err)
			}
			require.Equal(t, 100, m.Len())

			c.Set(base.Add(tc.dead))
			for range 60 {
				_, err := m.Allow(ctx, "busy")
				require.NoError(t, err)
			}
			require.Equal(t, 1, m.Len(), "only the busy key is left")
		})
	}
}

// TestMemoryHeapPerKey measures the heap that 1,000,000 distinct keys take
// in the memory tier (MaxKeys 1,000,000). Measured on Go 1.26, amd64, keys
// of 3 to 8 bytes: 136 bytes per key for each algorithm, 135.5 MB in all
// (see docs/MEMORY.md). The asserted bound, 200 bytes per key, leaves room for
// map growth landing differently. It does not run in parallel, so that no
// other test's allocations are counted.
func TestMemoryHeapPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates about 150 MB")
	}
	const keys = 1_000_000
	const bound = 200 // bytes per key
	for _, alg := range ratelimit.Algorithms {
		ctx := context.Background()
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		// A pinned clock: no key dies and is swept while the test runs.
		m := newMemory(t, ratelimit.Config{Name: "heap", Algorithm: alg, Limit: 60, Window: time.Minute},
			ratelimit.MemoryOptions{MaxKeys: keys, Now: func() time.Time { return base }})
		var buf []byte
		for i := range keys {
			buf = strconv.AppendInt(append(buf[:0], "k:"...), int64(i), 10)
			if _, err := m.Allow(ctx, string(buf)); err != nil {
				t.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		held := m.Len()
		perKey := float64(after.HeapAlloc-before.HeapAlloc) / float64(held)
		t.Logf("%s: %d keys held, heap %.1f MB, %.1f bytes/key", alg, held, float64(after.HeapAlloc-before.HeapAlloc)/1e6, perKey)
		require.Greater(t, held, keys*99/100, "sharding loses few keys to early eviction")
		require.LessOrEqual(t, perKey, float64(bound))
		runtime.KeepAlive(m)
	}
}
