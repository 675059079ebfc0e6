package ratelimit_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// A check with a request id counts once: sent again, it returns the first
// decision (Replayed) and counts nothing; other ids count as usual; a
// denial is replayed as a denial, even once the key has room again.
func TestRequestIDCountsOnce(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "once-" + string(alg), Algorithm: alg, Limit: 10,
				Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Minute))})
			first, err := l.Allow(ctx, "k", ratelimit.Cost(4), ratelimit.RequestID("req-1"))
			require.NoError(t, err)
			require.True(t, first.Allowed)
			require.False(t, first.Replayed)
			require.EqualValues(t, 6, first.Remaining)
			for range 3 {
				again, err := l.Allow(ctx, "k", ratelimit.Cost(4), ratelimit.RequestID("req-1"))
				require.NoError(t, err)
				require.True(t, again.Replayed)
				first.Replayed = true
				require.Equal(t, first, again, "the first decision, as it was")
			}
			peek, err := l.Peek(ctx, "k")
			require.NoError(t, err)
			require.EqualValues(t, 6, peek.Remaining, "counted once")

			// Another id counts; one that is denied is replayed denied.
			d, err := l.Allow(ctx, "k", ratelimit.Cost(6), ratelimit.RequestID("req-2"))
			require.NoError(t, err)
			require.True(t, d.Allowed)
			denied, err := l.Allow(ctx, "k", ratelimit.Cost(1), ratelimit.RequestID("req-3"))
			require.NoError(t, err)
			require.False(t, denied.Allowed)
			require.NoError(t, l.Reset(ctx, "k"))
			again, err := l.Allow(ctx, "k", ratelimit.Cost(1), ratelimit.RequestID("req-3"))
			require.NoError(t, err)
			require.True(t, again.Replayed)
			require.False(t, again.Allowed, "the first decision, a denial, though the key has room now")
			peek, err = l.Peek(ctx, "k")
			require.NoError(t, err)
			require.EqualValues(t, 10, peek.Remaining, "the replay counted nothing")

			// The id belongs to the key: the same id on another key counts.
			d, err = l.Allow(ctx, "other", ratelimit.Cost(4), ratelimit.RequestID("req-1"))
			require.NoError(t, err)
			require.False(t, d.Replayed)
			require.EqualValues(t, 6, d.Remaining)
		})
	}
}

// Many goroutines on several pools (as several instances would be) send
// checks of the same ids at once: each id is counted once, and every copy
// of a check returns the same decision.
func TestRequestIDConcurrentCopies(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			const instances, copies, ids, limit = 3, 4, 30, 20
			var lims []*ratelimit.Limiter
			for range instances {
				lims = append(lims, testkit.NewLimiter(t, dbtest.PoolOn(t, s), ratelimit.Config{Name: "copies-" + string(alg),
					Algorithm: alg, Limit: limit, Window: time.Hour, OnFailure: ratelimit.FailError}))
			}
			decs := make([][]ratelimit.Decision, ids)
			var mu sync.Mutex
			var wg sync.WaitGroup
			for id := range ids {
				for c := range instances * copies {
					wg.Add(1)
					go func() {
						defer wg.Done()
						d, err := lims[c%instances].Allow(ctx, "hot", ratelimit.RequestID(fmt.Sprint("id-", id)))
						require.NoError(t, err)
						mu.Lock()
						decs[id] = append(decs[id], d)
						mu.Unlock()
					}()
				}
			}
			wg.Wait()
			admitted := 0
			for id, ds := range decs {
				fresh := 0
				for _, d := range ds {
					require.Equal(t, ds[0].Allowed, d.Allowed, "id %d: every copy has the first decision", id)
					if !d.Replayed {
						fresh++
					}
				}
				require.Equal(t, 1, fresh, "id %d: one copy was decided, the others replayed it", id)
				if ds[0].Allowed {
					admitted++
				}
			}
			require.Equal(t, limit, admitted, "the limit admits %d distinct ids", limit)
			peek, err := lims[0].Peek(ctx, "hot")
			require.NoError(t, err)
			require.Zero(t, peek.Remaining)
		})
	}
}

// Request ids are refused where they cannot be kept, with a message that
// names the fix.
func TestRequestIDRefused(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "refused", Limit: 10, Window: time.Hour})
	spread := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "spread", Limit: 10, Window: time.Hour, Spread: 2})
	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "mem", Limit: 10, Window: time.Hour}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	for _, c := range []struct {
		name string
		run  func() error
		want string
	}{
		{"empty", func() error { _, err := l.Allow(ctx, "k", ratelimit.RequestID("")); return err }, "give 1 to 1024 bytes"},
		{"huge", func() error {
			_, err := l.Allow(ctx, "k", ratelimit.RequestID(strings.Repeat("x", ratelimit.MaxRequestIDLength+1)))
			return err
		}, "give 1 to 1024 bytes"},
		{"twice", func() error {
			_, err := l.Allow(ctx, "k", ratelimit.RequestID("a"), ratelimit.RequestID("b"))
			return err
		}, "given twice"},
		{"slice", func() error {
			_, err := l.Allow(ctx, "k", ratelimit.Slice(1, 5, 1), ratelimit.RequestID("a"))
			return err
		}, "with Slice"},
		{"peek", func() error { _, err := l.Peek(ctx, "k", ratelimit.RequestID("a")); return err }, "nothing is counted"},
		{"spread", func() error { _, err := spread.Allow(ctx, "k", ratelimit.RequestID("a")); return err }, "use Spread 1"},
		{"memory", func() error { _, err := mem.Allow(ctx, "k", ratelimit.RequestID("a")); return err }, "use a Limiter"},
	} {
		err := c.run()
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption, c.name)
		if c.name != "peek" { // a Peek counts nothing, and is no check
			require.ErrorIs(t, err, ratelimit.ErrNotConsumed, c.name)
		}
		require.ErrorContains(t, err, c.want, c.name)
	}
	// Any content is an id: hostile bytes are hashed, never interpreted.
	for _, id := range []string{"'; DROP TABLE pgrl_request; --", "\x00\xff", strings.Repeat("é", 500)} {
		d, err := l.Allow(ctx, "k", ratelimit.RequestID(id))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		d, err = l.Allow(ctx, "k", ratelimit.RequestID(id))
		require.NoError(t, err)
		require.True(t, d.Replayed)
	}
}
