package lease

import (
	"context"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// loginGroup is three leased limits on one database, a login's: per
// email and address, per address, per email; one per algorithm.
type loginGroup struct {
	lims   [3]*ratelimit.Limiter
	leases [3]*Limiter
}

func newLoginGroup(t *testing.T, c *testkit.Clock, limits [3]int64, opts Options, shadow bool) *loginGroup {
	t.Helper()
	pool, _ := dbtest.Pool(t)
	var o ratelimit.DatabaseOptions
	if c != nil {
		o.Now = c.Now
		opts.Now = c.Now
	}
	d := testkit.NewDatabase(t, pool, o)
	cfgs := [3]ratelimit.Config{
		{Name: "pair", Algorithm: ratelimit.FixedWindow, Limit: limits[0], Window: time.Minute},
		{Name: "ip", Algorithm: ratelimit.SlidingWindow, Limit: limits[1], Window: time.Minute},
		{Name: "email", Algorithm: ratelimit.TokenBucket, Limit: limits[2], Window: time.Hour, Shadow: shadow},
	}
	g := &loginGroup{}
	for i, cfg := range cfgs {
		g.lims[i] = testkit.Limiter(t, d, cfg)
		o := opts
		o.Size = min(o.Size, limits[i])
		g.leases[i] = newLease(t, g.lims[i], o)
	}
	return g
}

func (g *loginGroup) checks(pair, ip, email string) []Check {
	return []Check{{Limiter: g.leases[0], Key: pair}, {Limiter: g.leases[1], Key: ip}, {Limiter: g.leases[2], Key: email}}
}

func TestAllowAllAnswersFromTheSlices(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, [3]int64{100, 100, 100}, Options{Eager: true, Size: 10}, false)
	ctx := context.Background()

	md, err := AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
	require.NoError(t, err)
	require.True(t, md.Allowed)
	require.Equal(t, -1, md.DeniedBy)
	for i, d := range md.Decisions {
		require.True(t, d.Allowed)
		require.Equal(t, int64(1), d.Granted, "check %d", i)
		require.Equal(t, ratelimit.StorePostgres, d.Store, "check %d took its first slice", i)
		require.Equal(t, int64(1), d.Used, "check %d", i)
	}
	for i, key := range []string{"p", "i", "e"} {
		require.Equal(t, int64(10), peekUsed(t, g.lims[i], key), "slice %d is counted in PostgreSQL", i)
	}
	for n := 2; n <= 10; n++ {
		c.Add(time.Millisecond)
		md, err := AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
		require.NoError(t, err)
		require.True(t, md.Allowed)
		for i, d := range md.Decisions {
			require.Equal(t, ratelimit.StoreLease, d.Store, "group %d check %d", n, i)
			require.Equal(t, int64(1), d.Granted)
			require.Equal(t, int64(n), d.Used, "group %d check %d", n, i)
		}
	}
	for i, x := range g.leases {
		require.Equal(t, Stats{Slices: 1, Leased: 10, UsedLocally: 10, LocalDecisions: 9, DatabaseDecisions: 1}, x.Stats(), "lease %d", i)
	}
	// The 11th needs three slices, which are taken at once.
	md, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
	require.NoError(t, err)
	require.True(t, md.Allowed)
	for i := range g.leases {
		require.Equal(t, ratelimit.StorePostgres, md.Decisions[i].Store)
		require.Equal(t, int64(11), md.Decisions[i].Used)
	}
}

// TestAllowAllDeniedTakesNothing: a group one limit denies takes no unit
// from the others' slices; what a denied member's slice took stays for
// later checks.
func TestAllowAllDeniedTakesNothing(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, [3]int64{3, 100, 100}, Options{Eager: true, Size: 10}, false)
	ctx := context.Background()
	admitted := 0
	for n := 0; n < 10; n++ {
		c.Add(time.Millisecond)
		md, err := AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
		require.NoError(t, err)
		if md.Allowed {
			admitted++
			continue
		}
		require.Equal(t, 0, md.DeniedBy, "the pair's limit denies")
		for i, d := range md.Decisions {
			require.Zero(t, d.Granted, "group %d check %d: a denied group grants nothing", n, i)
		}
		require.False(t, md.Decisions[0].Allowed)
		require.True(t, md.Decisions[1].Allowed, "the address's limit allowed and took nothing")
		require.Greater(t, md.Decisions[0].RetryAfter, time.Duration(0))
	}
	require.Equal(t, 3, admitted)
	for i := 1; i < 3; i++ {
		s := g.leases[i].Stats()
		require.Equal(t, int64(3), s.UsedLocally, "lease %d: only the admitted groups used its units", i)
		require.Equal(t, int64(10), s.Leased, "lease %d: one slice was enough", i)
	}
	// A single check of the address's limit gets the units the denied
	// groups left in its slice.
	d, err := g.leases[1].Allow(ctx, "i")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreLease, d.Store)
	require.Equal(t, int64(4), d.Used)
}

// TestAllowAllColdSendsTheChecks: without Eager, a group with a key seen
// for the first time is sent as the caller's own checks, all or nothing in
// PostgreSQL; the next group takes slices.
func TestAllowAllColdSendsTheChecks(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, [3]int64{1, 100, 100}, Options{Size: 10, Idle: time.Minute}, false)
	ctx := context.Background()

	md, err := AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
	require.NoError(t, err)
	require.True(t, md.Allowed)
	for i, d := range md.Decisions {
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.Equal(t, int64(1), peekUsed(t, g.lims[i], []string{"p", "i", "e"}[i]), "check %d counted its own unit, no slice", i)
	}
	// The pair's limit of 1 is spent: the group is denied in PostgreSQL,
	// all or nothing, and nothing is counted for the address.
	c.Add(time.Millisecond)
	md, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i2", "e")...)
	require.NoError(t, err)
	require.False(t, md.Allowed)
	require.Equal(t, 0, md.DeniedBy)
	require.Zero(t, peekUsed(t, g.lims[1], "i2"))
	// Warm keys take slices now.
	c.Add(time.Millisecond)
	md, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p2", "i", "e")...)
	require.NoError(t, err)
	require.True(t, md.Allowed, "p2 is cold: sent as is")
	c.Add(time.Millisecond)
	md, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p3", "i", "e")...)
	require.NoError(t, err)
	require.True(t, md.Allowed)
	c.Add(time.Millisecond)
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p3", "i", "e")...)
	require.NoError(t, err)
	require.Equal(t, int64(1), g.leases[1].Stats().Slices, "the address took a slice once warm")
}

// TestAllowAllShadowNeverVetoes: a limit in shadow mode that runs out
// reports ShadowDenied and lets the group through, as ratelimit.AllowAll.
func TestAllowAllShadowNeverVetoes(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, [3]int64{100, 100, 2}, Options{Eager: true, Size: 10}, true)
	ctx := context.Background()
	for n := 1; n <= 4; n++ {
		c.Add(time.Millisecond)
		md, err := AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
		require.NoError(t, err)
		require.True(t, md.Allowed, "group %d", n)
		require.Equal(t, n > 2, md.Decisions[2].ShadowDenied, "group %d", n)
		require.Equal(t, int64(n), md.Decisions[0].Used, "%+v", md)
	}
}

func TestAllowAllRefusesBadGroups(t *testing.T) {
	t.Parallel()
	g := newLoginGroup(t, nil, [3]int64{10, 10, 10}, Options{Eager: true, Size: 5}, false)
	ctx := context.Background()
	_, err := AllowAll(ctx, ratelimit.AllOrNothing)
	require.ErrorIs(t, err, ratelimit.ErrEmptyMulti)
	_, err = AllowAll(ctx, ratelimit.MultiMode(7), g.checks("p", "i", "e")...)
	require.ErrorIs(t, err, ratelimit.ErrInvalidMultiMode)
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Key: "k"})
	require.ErrorIs(t, err, ErrNilLimiter)
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "k"}, Check{Limiter: g.leases[0], Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrDuplicateCheck)
	require.Contains(t, err.Error(), "summed cost")
	for _, cost := range []int64{-1, math.MinInt64} {
		_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "k", Cost: cost})
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	}
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "k", Cost: 11})
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "k", Cost: math.MaxInt64})
	require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
	require.Equal(t, ratelimit.OutcomeNotConsumed, ratelimit.OutcomeOf(err))
	for i, l := range g.lims {
		require.Zero(t, peekUsed(t, l, []string{"k", "k", "k"}[i]), "nothing was counted")
	}
	// An empty key and a key of a megabyte are keys as any other (hashed),
	// cold and then warm.
	for range 2 {
		for _, key := range []string{"", strings.Repeat("k", 1<<20)} {
			md, err := AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "p"}, Check{Limiter: g.leases[1], Key: key})
			require.NoError(t, err, "key of %d bytes", len(key))
			require.True(t, md.Allowed)
		}
	}
	// A limiter of another Database: refused on every group, whether the
	// slices would have answered it or not.
	pool, _ := dbtest.Pool(t)
	other := newLease(t, testkit.NewLimiter(t, pool, ratelimit.Config{Name: "other", Limit: 10, Window: time.Minute}, ratelimit.DatabaseOptions{}), Options{Eager: true, Size: 5})
	for range 3 {
		_, err = AllowAll(ctx, ratelimit.AllOrNothing, Check{Limiter: g.leases[0], Key: "k"}, Check{Limiter: other, Key: "k"})
		require.ErrorIs(t, err, ratelimit.ErrMixedDatabases)
		require.Contains(t, err.Error(), "lease limiters made on one pool")
	}
	require.NoError(t, g.leases[2].Close(ctx))
	_, err = AllowAll(ctx, ratelimit.AllOrNothing, g.checks("p", "i", "e")...)
	require.ErrorIs(t, err, ErrClosed)
}

func TestAllowAllConsumeAll(t *testing.T) {
	t.Parallel()
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, [3]int64{1, 100, 100}, Options{Eager: true, Size: 10}, false)
	ctx := context.Background()
	for n := 1; n <= 3; n++ {
		c.Add(time.Millisecond)
		md, err := AllowAll(ctx, ratelimit.ConsumeAll, g.checks("p", "i", "e")...)
		require.NoError(t, err)
		require.Equal(t, n == 1, md.Allowed)
		require.Equal(t, int64(n), md.Decisions[1].Used, "ConsumeAll counts the others even when one denies")
	}
}

// TestAllowAllNeverOverUnderContention: goroutines check overlapping
// groups in every order at once; no limit admits more than its limit, a
// denied group takes nothing, and no two groups wait on each other for
// ever.
func TestAllowAllNeverOverUnderContention(t *testing.T) {
	t.Parallel()
	limits := [3]int64{20, 50, 200}
	// One instant for the whole run: on the wall clock a run that crosses
	// a minute boundary starts the pairs' and the addresses' next windows,
	// and more than a limit is then rightly admitted over the run.
	c := testkit.NewClock(base.Add(10 * time.Second))
	g := newLoginGroup(t, c, limits, Options{Eager: true, Size: 8, Share: 2}, false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys := [3][]string{{"p0", "p1"}, {"i0", "i1"}, {"e0"}}
	var admitted [3]sync.Map
	var wg sync.WaitGroup
	var groups atomic.Int64
	for w := range 16 {
		wg.Go(func() {
			for n := range 60 {
				pair, ip, email := keys[0][(w+n)%2], keys[1][(w/2+n)%2], keys[2][0]
				checks := g.checks(pair, ip, email)
				if w%2 == 1 {
					checks[0], checks[2] = checks[2], checks[0]
				}
				md, err := AllowAll(ctx, ratelimit.AllOrNothing, checks...)
				if err != nil {
					t.Error(err)
					return
				}
				groups.Add(1)
				if !md.Allowed {
					for _, d := range md.Decisions {
						if d.Granted != 0 {
							t.Errorf("denied group granted %d", d.Granted)
						}
					}
					continue
				}
				for _, c := range checks {
					i := map[*Limiter]int{g.leases[0]: 0, g.leases[1]: 1, g.leases[2]: 2}[c.Limiter]
					v, _ := admitted[i].LoadOrStore(c.Key, new(atomic.Int64))
					v.(*atomic.Int64).Add(1)
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, ctx.Err(), "no group waited for ever")
	require.Equal(t, int64(16*60), groups.Load())
	total := int64(0)
	for i := range admitted {
		admitted[i].Range(func(k, v any) bool {
			n := v.(*atomic.Int64).Load()
			require.LessOrEqual(t, n, limits[i], "limit %d key %v", i, k)
			require.LessOrEqual(t, n, peekUsed(t, g.lims[i], k.(string)), "limit %d key %v: every admitted unit was counted", i, k)
			if i == 0 {
				total += n
			}
			return true
		})
	}
	// The email's limit of 200 and the address's 2 × 50 do not bind
	// before the pairs' 2 × 20, and demand (960 groups) is far above it:
	// one process strands no unit, so the pairs are spent exactly.
	require.Equal(t, int64(40), total, "groups admitted")
}
