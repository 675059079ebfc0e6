package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// On Citus, a policy limiter checks with the cached policy (Citus does not
// run a check that reads its policy in the statement), counts exactly on the distributed counter table, and follows a change
// made by plain SQL through the NOTIFY of the policy tables' triggers,
// which fire on the coordinator, where the listener is connected. The
// listener never resynchronises on a timer here, so only a notification
// can bring the change.
func TestCitusPolicyLimiterFollowsNotifications(t *testing.T) {
	ctx := context.Background()
	if ok, err := migration.HasCitus(ctx, dbtest.Admin(t)); err != nil || !ok {
		t.Skip("the test database has no citus extension (see scripts/citus.sh)")
	}
	pool, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)

	cache := policy.NewCache(pool)
	lis, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, lis.WaitSynced(wctx))

	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache,
		Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})})
	require.NoError(t, err)
	allowed := 0
	for range 3 {
		d, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		if d.Allowed {
			allowed++
		}
	}
	require.Equal(t, 2, allowed)

	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 5 WHERE name = 'api'`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		p, err := lim.Policy()
		return err == nil && p.Limit == 5
	}, 20*time.Second, 10*time.Millisecond, "the UPDATE's notification reached the listener")
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', pgrl_stored_key('api', 'vip'), 7)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		d, err := lim.Peek(ctx, "vip")
		return err == nil && d.Limit == 7
	}, 20*time.Second, 10*time.Millisecond, "the override's notification reached the listener")
	require.Positive(t, lis.Stats().Applied)
	require.Zero(t, lis.Stats().Dropped)
}
