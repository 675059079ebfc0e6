package ratelimit

import (
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// denial is a Postgres denial made at the database's instant dbNow, with
// its clock deliberately far from the local one: the cache must use only
// RetryAfter and ResetAt - Now, never the database's instants themselves.
func denial(retry, resetAfter time.Duration) Decision {
	dbNow := time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)
	return Decision{
		Allowed:    false,
		Limit:      5,
		Remaining:  2, // a denial for a large cost may leave some room
		ResetAt:    dbNow.Add(resetAfter),
		RetryAfter: retry,
		Now:        dbNow,
		Store:      StorePostgres,
	}
}

func TestDenyCacheAnswersWithinThePeriod(t *testing.T) {
	t.Parallel()
	c := newDenyCache(100)
	sent := time.Now()
	c.put("k", 1, denial(10*time.Second, 30*time.Second), sent)

	for _, tc := range []struct {
		at    time.Duration
		found bool
	}{
		{0, true},
		{5 * time.Second, true},
		{10*time.Second - time.Nanosecond, true},
		{10 * time.Second, false}, // the denial is over: ask PostgreSQL again
		{11 * time.Second, false},
	} {
		now := sent.Add(tc.at)
		d, ok := c.get("k", 1, now)
		require.Equal(t, tc.found, ok, "at %v", tc.at)
		if !ok {
			continue
		}
		require.False(t, d.Allowed)
		require.Equal(t, StoreDenyCache, d.Store)
		require.Equal(t, int64(0), d.Remaining)
		require.Equal(t, int64(5), d.Limit)
		require.Equal(t, 10*time.Second-tc.at, d.RetryAfter, "RetryAfter shrinks as time passes")
		require.Equal(t, now, d.Now)
		require.True(t, d.ResetAt.Equal(sent.Add(30*time.Second)), "ResetAt is moved to the local clock")
		require.NotEmpty(t, d.Reason)
	}
	// An expired entry is dropped when met.
	require.Zero(t, c.len())
	_, ok := c.get("other", 1, sent)
	require.False(t, ok)
}

func TestDenyCacheStoresOnlyPostgresDenials(t *testing.T) {
	t.Parallel()
	c := newDenyCache(100)
	now := time.Now()
	allowed := denial(0, time.Second)
	allowed.Allowed = true
	c.put("allowed", 1, allowed, now)
	c.put("no-retry", 1, denial(0, time.Second), now)
	c.put("negative", 1, denial(-time.Second, time.Second), now)
	mem := denial(time.Second, time.Second)
	mem.Store = StoreMemory
	c.put("memory", 1, mem, now)
	c.put("bad-cost", 0, denial(time.Second, time.Second), now)
	require.Zero(t, c.len())
	for _, k := range []string{"allowed", "no-retry", "negative", "memory", "bad-cost"} {
		_, ok := c.get(k, 1, now)
		require.False(t, ok, k)
	}
}

// A denial for cost n says nothing about smaller costs.
func TestDenyCacheRespectsCost(t *testing.T) {
	t.Parallel()
	c := newDenyCache(100)
	now := time.Now()
	c.put("k", 3, denial(time.Minute, time.Minute), now)
	for _, tc := range []struct {
		cost  int64
		found bool
	}{{1, false}, {2, false}, {3, true}, {5, true}} {
		_, ok := c.get("k", tc.cost, now.Add(time.Second))
		require.Equal(t, tc.found, ok, "cost %d", tc.cost)
	}

	// A denial for a smaller cost replaces it: it answers more checks.
	c.put("k", 1, denial(20*time.Second, time.Minute), now.Add(time.Second))
	d, ok := c.get("k", 1, now.Add(time.Second))
	require.True(t, ok)
	require.Equal(t, 20*time.Second, d.RetryAfter)

	// A running entry for a smaller cost is not replaced by a larger one.
	c.put("k", 4, denial(time.Hour, time.Hour), now.Add(2*time.Second))
	d, ok = c.get("k", 1, now.Add(2*time.Second))
	require.True(t, ok)
	require.Equal(t, 19*time.Second, d.RetryAfter)

	// Once it has run out, any denial replaces it.
	c.put("k", 4, denial(time.Hour, time.Hour), now.Add(time.Minute))
	_, ok = c.get("k", 1, now.Add(time.Minute))
	require.False(t, ok)
	_, ok = c.get("k", 4, now.Add(time.Minute))
	require.True(t, ok)

	// forget drops the entry, as a Reset must.
	c.forget("k")
	_, ok = c.get("k", 4, now.Add(time.Minute))
	require.False(t, ok)
}

func TestDenyCacheBounded(t *testing.T) {
	t.Parallel()
	const maxKeys = 500
	c := newDenyCache(maxKeys)
	now := time.Now()
	long := strings.Repeat("z", 1<<16)
	for i := range 10 * maxKeys {
		c.put(long+strconv.Itoa(i), 1, denial(time.Hour, time.Hour), now)
		require.LessOrEqual(t, c.len(), maxKeys)
	}
	_, ok := c.get(long+strconv.Itoa(10*maxKeys-1), 1, now)
	require.True(t, ok, "the most recent denial is kept")
	_, ok = c.get(long+"0", 1, now)
	require.False(t, ok, "the oldest was evicted")

	c2 := newDenyCache(0)
	require.Equal(t, defaultDenyCacheKeys/denyCacheShards, c2.keys.shards[0].max)
}

// Expired entries are swept from the cold end of their shard as new ones
// arrive, before the cap forces evictions.
func TestDenyCacheSweepsExpired(t *testing.T) {
	t.Parallel()
	c := newDenyCache(10_000)
	now := time.Now()
	for i := range 100 {
		c.put("old"+strconv.Itoa(i), 1, denial(time.Second, time.Second), now)
	}
	require.Equal(t, 100, c.len())
	later := now.Add(time.Minute)
	for i := range 1000 {
		c.put("new"+strconv.Itoa(i), 1, denial(time.Second, time.Second), later)
	}
	require.Less(t, c.len(), 1000+100/2, "most expired entries were swept")
	require.GreaterOrEqual(t, c.len(), 1000)
}

func TestDenyCacheConcurrent(t *testing.T) {
	t.Parallel()
	c := newDenyCache(64)
	now := time.Now()
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 2000 {
				k := strconv.Itoa((g*7 + i) % 100)
				if i%3 == 0 {
					c.put(k, int64(1+i%2), denial(time.Second, time.Second), now)
				} else if d, ok := c.get(k, 2, now.Add(time.Duration(i)*time.Microsecond)); ok && d.Allowed {
					panic("the deny cache allowed")
				}
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, c.len(), 64)
}
