package ratelimit_test

import (
	"context"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// model is a reference implementation of the three algorithms, written
// from their documented semantics, with time in microseconds.
type model struct {
	cfg      ratelimit.Config
	windowUs int64
	refill   float64
	fixed    map[string]map[int64]int64 // key -> window end -> count
	bucket   map[string]*bucketState
	sliding  map[string]*slidingState
}

type bucketState struct {
	tokens  float64
	updated int64
}

type slidingState struct {
	start, cur, prev int64
}

func newModel(cfg ratelimit.Config) *model {
	if cfg.Burst == 0 {
		cfg.Burst = cfg.Limit
	}
	w := cfg.Window.Microseconds()
	return &model{
		cfg: cfg, windowUs: w, refill: float64(cfg.Limit) / float64(w),
		fixed: map[string]map[int64]int64{}, bucket: map[string]*bucketState{}, sliding: map[string]*slidingState{},
	}
}

// take returns whether the check is allowed and the remaining units.
func (m *model) take(key string, cost, now int64) (bool, int64) {
	c := m.cfg
	switch c.Algorithm {
	case ratelimit.TokenBucket:
		capacity := float64(c.Burst)
		s, ok := m.bucket[key]
		if !ok {
			s = &bucketState{tokens: capacity, updated: now}
			m.bucket[key] = s
		}
		avail := math.Min(capacity, s.tokens+float64(max(now-s.updated, 0))*m.refill)
		allowed := avail >= float64(cost)
		switch {
		case allowed:
			s.tokens = avail - float64(cost)
		case c.Penalty:
			s.tokens = math.Max(avail-float64(cost), -capacity)
		default:
			s.tokens = avail
		}
		s.updated = max(s.updated, now)
		return allowed, int64(math.Floor(math.Max(s.tokens, 0)))
	case ratelimit.SlidingWindow:
		w := m.windowUs
		ws := now - now%w
		s, ok := m.sliding[key]
		if !ok {
			s = &slidingState{start: ws}
			m.sliding[key] = s
		}
		var cur, prev int64
		switch {
		case s.start >= ws:
			cur, prev = s.cur, s.prev
		case s.start == ws-w:
			prev = s.cur
		}
		start := max(s.start, ws)
		e := min(max(now-start, 0), w)
		lhs := new(big.Int).Mul(big.NewInt(prev), big.NewInt(w-e))
		lhs.Add(lhs, new(big.Int).Mul(big.NewInt(cur+cost), big.NewInt(w)))
		allowed := lhs.Cmp(new(big.Int).Mul(big.NewInt(c.Limit), big.NewInt(w))) <= 0
		if allowed || c.Penalty {
			cur += cost
		}
		*s = slidingState{start: start, cur: cur, prev: prev}
		est := float64(prev)*float64(w-e)/float64(w) + float64(cur)
		return allowed, int64(math.Floor(math.Max(float64(c.Limit)-est, 0) + 1e-9))
	default:
		end := now - now%m.windowUs + m.windowUs
		if m.fixed[key] == nil {
			m.fixed[key] = map[int64]int64{}
		}
		n := m.fixed[key][end]
		allowed := n+cost <= c.Limit
		if allowed || c.Penalty {
			n += cost
		}
		m.fixed[key][end] = n
		return allowed, max(c.Limit-n, 0)
	}
}

// dbVariant is one way of reaching the database.
type dbVariant struct {
	name string
	open func(t *testing.T) ratelimit.DB
}

// dbVariants covers a pool in each of pgx's exec modes, a single
// connection, and a transaction.
func dbVariants() []dbVariant {
	var vs []dbVariant
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{
		{"pool/cache_statement", pgx.QueryExecModeCacheStatement},
		{"pool/cache_describe", pgx.QueryExecModeCacheDescribe},
		{"pool/describe_exec", pgx.QueryExecModeDescribeExec},
		{"pool/exec", pgx.QueryExecModeExec},
		{"pool/simple_protocol", pgx.QueryExecModeSimpleProtocol},
	} {
		vs = append(vs, dbVariant{m.name, func(t *testing.T) ratelimit.DB {
			pool, _ := dbtest.Pool(t, dbtest.WithExecMode(m.mode))
			return pool
		}})
	}
	vs = append(vs,
		dbVariant{"conn", func(t *testing.T) ratelimit.DB {
			pool, _ := dbtest.Pool(t)
			c, err := pool.Acquire(context.Background())
			require.NoError(t, err)
			t.Cleanup(c.Release)
			return c.Conn()
		}},
		dbVariant{"tx", func(t *testing.T) ratelimit.DB {
			pool, _ := dbtest.Pool(t)
			tx, err := pool.Begin(context.Background())
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			return tx
		}},
	)
	return vs
}

// TestMatchesModel replays random sequences of (key, cost, time step) with
// the clock pinned and compares every decision with the reference model,
// through every way of reaching the database.
func TestMatchesModel(t *testing.T) {
	t.Parallel()
	for _, v := range dbVariants() {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			db := v.open(t)
			for _, alg := range ratelimit.Algorithms {
				for _, penalty := range []bool{false, true} {
					seed := uint64(len(v.name))*1000 + uint64(len(alg))
					if penalty {
						seed++
					}
					replay(t, db, alg, penalty, seed)
				}
			}
		})
	}
}

func replay(t *testing.T, db ratelimit.DB, alg ratelimit.Algorithm, penalty bool, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	windows := []time.Duration{time.Second, 7 * time.Second, time.Minute}
	window := windows[rng.IntN(len(windows))]
	cfg := ratelimit.Config{
		Name: fmt.Sprintf("model-%s-%v-%d", alg, penalty, seed), Algorithm: alg,
		Limit: int64(3 + rng.IntN(8)), Window: window, Penalty: penalty,
		DenyCacheSize: -1, // every decision from PostgreSQL, with its exact Remaining
	}
	if alg == ratelimit.TokenBucket {
		cfg.Burst = cfg.Limit + int64(rng.IntN(5))
	}
	now := base.Add(time.Duration(rng.IntN(1e6)) * time.Microsecond)
	l, err := testkit.New(db, cfg, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: func() time.Time { return now }})
	require.NoError(t, err)
	m := newModel(cfg)
	capacity := cfg.Limit
	if alg == ratelimit.TokenBucket {
		capacity = cfg.Burst
	}
	keys := []string{"a", "b", "c"}
	ctx := context.Background()
	for i := range 150 {
		key := keys[rng.IntN(len(keys))]
		cost := 1 + rng.Int64N(min(capacity, 4))
		step := time.Duration(rng.Int64N(window.Microseconds()*2/5)) * time.Microsecond
		if rng.IntN(4) == 0 {
			step = 0
		}
		now = now.Add(step)
		d, err := l.Allow(ctx, key, ratelimit.Cost(cost))
		require.NoError(t, err)
		wantAllowed, wantRemaining := m.take(key, cost, now.UnixMicro())
		require.Equal(t, wantAllowed, d.Allowed, "%s step %d key %s cost %d at %v", cfg.Name, i, key, cost, now)
		require.Equal(t, wantRemaining, d.Remaining, "%s step %d remaining", cfg.Name, i)
		if !d.Allowed {
			require.Positive(t, d.RetryAfter, "%s step %d: a denial says when to retry", cfg.Name, i)
		} else {
			require.Zero(t, d.RetryAfter)
		}
		require.True(t, d.Now.Equal(now), "decision instant")
	}
}

// TestBatchMatchesModel drives the batched statements that coalesced checks
// share (one statement for several distinct keys) through random sequences
// with the clock pinned, refill and window changes included, and compares
// every decision with the reference model, costs over the limit included.
func TestBatchMatchesModel(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/penalty=%v", alg, penalty), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(uint64(len(alg)), uint64(b2u(penalty))))
				window := 7 * time.Second
				cfg := ratelimit.Config{Name: fmt.Sprintf("batch-model-%s-%v", alg, penalty), Algorithm: alg,
					Limit: 6, Window: window, Penalty: penalty, DenyCacheSize: -1}
				if alg == ratelimit.TokenBucket {
					cfg.Burst = 9
				}
				now := base.Add(time.Duration(rng.IntN(1e6)) * time.Microsecond)
				l, err := testkit.New(pool, cfg, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: func() time.Time { return now }})
				require.NoError(t, err)
				m := newModel(cfg)
				keys := []string{"a", "b", "c", "d", "e"}
				for i := range 200 {
					// Mostly no time at all, so that balances run out and
					// land exactly on a cost; now and then a refill or a
					// new window.
					var step time.Duration
					switch rng.IntN(6) {
					case 0:
						step = time.Duration(rng.Int64N(window.Microseconds()*2/5)) * time.Microsecond
					case 1:
						step = time.Duration(rng.Int64N(window.Microseconds()/20)) * time.Microsecond
					}
					now = now.Add(step)
					picked := rng.Perm(len(keys))[:1+rng.IntN(len(keys))]
					batch := make([]string, len(picked))
					costs := make([]int64, len(picked))
					for j, k := range picked {
						batch[j] = keys[k]
						costs[j] = 1 + rng.Int64N(4)
						if rng.IntN(8) == 0 {
							// Now and then a cost over the limit (the
							// burst) or, for the token bucket, over twice
							// the burst, which the batch's proposed row
							// already denies.
							costs[j] = 7 + rng.Int64N(15)
						}
					}
					ds, err := ratelimit.TakeMany(ctx, l, batch, costs)
					require.NoError(t, err)
					for j, d := range ds {
						wantAllowed, wantRemaining := m.take(batch[j], costs[j], now.UnixMicro())
						require.Equal(t, wantAllowed, d.Allowed, "step %d key %s cost %d", i, batch[j], costs[j])
						require.Equal(t, wantRemaining, d.Remaining, "step %d key %s remaining", i, batch[j])
						if !d.Allowed {
							require.Positive(t, d.RetryAfter, "step %d: a denial says when to retry", i)
						}
					}
				}
			})
		}
	}
}

func b2u(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestRetryAfterIsHonest checks for every algorithm that a denied check
// retried exactly RetryAfter later is admitted, and retried a microsecond
// earlier is not.
func TestRetryAfterIsHonest(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		rng := rand.New(rand.NewPCG(uint64(len(alg)), 11))
		for trial := range 20 {
			now := base.Add(time.Duration(rng.IntN(60e6)) * time.Microsecond)
			cfg := ratelimit.Config{Name: fmt.Sprintf("retry-%s-%d", alg, trial), Algorithm: alg, Limit: 5, Window: 10 * time.Second}
			l, err := testkit.New(pool, cfg, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: func() time.Time { return now }})
			require.NoError(t, err)
			var denied ratelimit.Decision
			cost := int64(1 + rng.IntN(3))
			for {
				d, err := l.Allow(ctx, "k", ratelimit.Cost(cost))
				require.NoError(t, err)
				if !d.Allowed {
					denied = d
					break
				}
				now = now.Add(time.Duration(rng.IntN(2e6)) * time.Microsecond)
			}
			at := now
			now = at.Add(denied.RetryAfter - time.Microsecond)
			p, err := l.Peek(ctx, "k")
			require.NoError(t, err)
			if cost == 1 {
				require.False(t, p.Allowed, "%s trial %d: admitted before RetryAfter (%v)", alg, trial, denied.RetryAfter)
			}
			now = at.Add(denied.RetryAfter)
			d, err := l.Allow(ctx, "k", ratelimit.Cost(cost))
			require.NoError(t, err)
			require.True(t, d.Allowed, "%s trial %d: denied at RetryAfter (%v)", alg, trial, denied.RetryAfter)
		}
	}
}

// TestSlidingWindowBound checks the documented bound of the sliding
// window counter against an exact log of admissions: no aligned window
// admits more than Limit, and no span of one Window admits more than
// 2×Limit.
func TestSlidingWindowBound(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 5))
	now := base
	const limit = 10
	w := 10 * time.Second
	l, err := testkit.New(pool, ratelimit.Config{Name: "bound", Algorithm: ratelimit.SlidingWindow, Limit: limit, Window: w}, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: func() time.Time { return now }})
	require.NoError(t, err)
	var admitted []time.Time
	for range 600 {
		// Bursty traffic: clusters of checks with quiet gaps.
		if rng.IntN(10) == 0 {
			now = now.Add(time.Duration(rng.Int64N(int64(w))))
		} else {
			now = now.Add(time.Duration(rng.Int64N(int64(200 * time.Millisecond))))
		}
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		if d.Allowed {
			admitted = append(admitted, now)
		}
	}
	maxSpan, maxAligned := 0, map[int64]int{}
	for i, a := range admitted {
		n := 0
		for _, b := range admitted[i:] {
			if b.Sub(a) < w {
				n++
			}
		}
		maxSpan = max(maxSpan, n)
		maxAligned[a.UnixMicro()/w.Microseconds()]++
	}
	for win, n := range maxAligned {
		require.LessOrEqual(t, n, limit, "aligned window %d", win)
	}
	require.LessOrEqual(t, maxSpan, 2*limit)
	t.Logf("admitted %d; most in any %v span: %d (limit %d)", len(admitted), w, maxSpan, limit)
}
