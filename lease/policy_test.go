package lease

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// A policy's slices follow the policy: a change (here a lower limit, then
// an override of one key) ends the key's slice at its next check, returns
// its units, and the next slice is taken at the new figures.
func TestLeasePolicyChangeEndsTheSlice(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base.Add(10 * time.Second))
	db := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: c.Now})
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "leased", Limit: 100, Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	require.NoError(t, cache.Reload(ctx))
	pl, err := policy.NewLimiter(ctx, pool, "leased", policy.Options{FromCache: true, Cache: cache, Database: db})
	require.NoError(t, err)
	x, err := NewPolicy(pl, Options{Eager: true, Size: 10, DB: pool, Now: c.Now, Idle: time.Hour})
	require.NoError(t, err)
	t.Cleanup(func() { _ = x.Close(ctx) })
	require.Equal(t, int64(100), x.Config().Limit)

	d, err := x.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(100), d.Limit)
	require.Equal(t, int64(10), peekUsed(t, pl, "k"), "a slice of Size")
	d, err = x.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreLease, d.Store)

	p.Limit = 40
	_, err = policy.Set(ctx, pool, p)
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "leased"))
	d, err = x.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store, "the old slice ended")
	require.Equal(t, int64(40), d.Limit)
	require.Equal(t, int64(8), x.Stats().Returned)
	// 2 used; the new slice: ceil(38/8) = 5, of which this check took 1.
	require.Equal(t, int64(7), peekUsed(t, pl, "k"))

	// An override of the key: the same again, at the override's limit.
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "leased", Key: p.StoredKey("k"), Limit: 1000})
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "leased"))
	d, err = x.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, int64(1000), d.Limit)
	require.Equal(t, int64(12), x.Stats().Returned)
	require.Equal(t, int64(3+10), peekUsed(t, pl, "k"))
	// Another key keeps the policy's limit.
	d, err = x.Allow(ctx, "other")
	require.NoError(t, err)
	require.Equal(t, int64(40), d.Limit)

	// A policy the lease cannot take any more (a penalised token bucket)
	// fails the check, and
	// counts nothing.
	p.Algorithm, p.Limit, p.Penalty = ratelimit.TokenBucket, 40, true
	_, err = policy.Set(ctx, pool, p)
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "leased"))
	_, err = x.Allow(ctx, "other")
	require.ErrorIs(t, err, ErrUnsupported)
}

func TestLeasePolicyRefusals(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	db := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{})
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "stmt", Limit: 100, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "bucket", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Minute, Penalty: true})
	require.NoError(t, err)

	_, err = NewPolicy(nil, Options{Eager: true, Size: 1})
	require.ErrorIs(t, err, ErrNilLimiter)
	var citus bool
	require.NoError(t, pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')").Scan(&citus))
	if !citus { // on Citus every policy limiter checks from its cache
		pl, err := policy.NewLimiter(ctx, pool, "stmt", policy.Options{Database: db})
		require.NoError(t, err)
		_, err = NewPolicy(pl, Options{Eager: true, Size: 1})
		require.ErrorIs(t, err, ErrUnsupported)
		require.Contains(t, err.Error(), "FromCache")
	}
	pl, err := policy.NewLimiter(ctx, pool, "bucket", policy.Options{Database: db, FromCache: true})
	require.NoError(t, err)
	_, err = NewPolicy(pl, Options{Eager: true, Size: 1})
	require.ErrorIs(t, err, ErrUnsupported)
	pl, err = policy.NewLimiter(ctx, pool, "stmt", policy.Options{Database: db, FromCache: true})
	require.NoError(t, err)
	_, err = NewPolicy(pl, Options{Eager: true, Size: 0})
	require.ErrorIs(t, err, ErrInvalidSize)
}
