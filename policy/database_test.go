package policy_test

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestLimiterFromDatabase: with Options.Database, the policy's limits are
// the Database's: its Observer sees their decisions, its breaker judges the
// database for them and survives a reload of the policy, and a per-database
// field cannot be set in Config as well.
func TestLimiterFromDatabase(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "from-db", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	obs := &testkit.Observer{}
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Observer: obs})
	require.NoError(t, err)
	lim, err := newLimiter(ctx, pool, "from-db", policy.Options{Database: limits})
	require.NoError(t, err)
	for _, want := range []bool{true, true, false} {
		d, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, want, d.Allowed)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
	}
	require.Equal(t, []string{"from-db true", "from-db true", "from-db false"}, nameAndAllowed(obs), "the Database's Observer")
	l, err := lim.For("k")
	require.NoError(t, err)
	require.Equal(t, testkit.DecisionTimeout, limits.Options().Timeout, "the Database's Timeout")
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, []string{"from-db true", "from-db true", "from-db false", "from-db false"}, nameAndAllowed(obs),
		"the policy's limit is the Database's")

	// A per-database field cannot be set in Config as well: Config has
	// none (the Observer is DatabaseOptions.Observer).
	_, inConfig := reflect.TypeFor[ratelimit.Config]().FieldByName("Observer")
	require.False(t, inConfig, "Config.Observer")

	// The Database's breaker: a database that refuses connections opens it
	// after two failures, and it stays open across a reload of the policy
	// (checks from the cache, which the live pool loaded).
	cache := policy.NewCache(pool)
	require.NoError(t, cache.Reload(ctx))
	down, err := ratelimit.NewDatabase(testkit.DeadPool(t), ratelimit.DatabaseOptions{BreakerThreshold: 2,
		BreakerCooldown: time.Hour, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	dl, err := newLimiter(ctx, pool, "from-db", policy.Options{Database: down, Cache: cache, FromCache: true})
	require.NoError(t, err)
	for range 2 {
		d, err := dl.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StoreMemory, d.Store)
	}
	l, err = dl.For("k")
	require.NoError(t, err)
	require.True(t, l.BreakerOpen())
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "from-db", Limit: 3, Window: time.Hour})
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "from-db"))
	l, err = dl.For("k")
	require.NoError(t, err)
	require.Equal(t, int64(3), l.Config().Limit, "rebuilt from the reloaded policy")
	require.True(t, l.BreakerOpen(), "the rebuilt limiter keeps the Database's open breaker")
}

// TestLimiterRefusesAtRate: a policy holds its rate, so a rate given with a
// call is refused on every verb, counting nothing; Cost and UpTo apply.
func TestLimiterRefusesAtRate(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "no-rate", Limit: 5, Window: time.Hour})
	require.NoError(t, err)
	lim, err := newLimiter(ctx, pool, "no-rate", policy.Options{})
	require.NoError(t, err)
	r := ratelimit.AtRate(ratelimit.Rate{Limit: 100, Window: time.Hour})
	_, err = lim.Allow(ctx, "k", ratelimit.Cost(2), r)
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorContains(t, err, "override")
	_, err = lim.Peek(ctx, "k", r)
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorIs(t, lim.Reset(ctx, "k", r), ratelimit.ErrInvalidOption)
	d, err := lim.Allow(ctx, "k", ratelimit.UpTo(9))
	require.NoError(t, err)
	require.Equal(t, int64(5), d.Granted, "UpTo applies to a policy's limit")
}

// nameAndAllowed is each decision obs saw as "name allowed".
func nameAndAllowed(obs *testkit.Observer) []string {
	var out []string
	for i, d := range obs.Decisions() {
		out = append(out, fmt.Sprintf("%s %v", obs.Names()[i], d.Allowed))
	}
	return out
}
