package tests

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// Limits stored in the database, under the documented roles: the migration
// role writes policies, the application role (rights from `rl-migrate up
// --grant-to` only) reads them, listens for changes and checks, and cannot
// change a limit.
func TestRolesApplicationRoleReadsPolicies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	owner := rs.poolAs(t, rs.owner)
	app := rs.poolAs(t, rs.app)

	_, err := policy.Set(ctx, owner, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	cache := policy.NewCache(app)
	l, err := policy.Watch(ctx, dbtest.URLAsWithSchema(rs.app, rs.schema), cache, policy.ListenerOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	api, err := policy.NewLimiter(ctx, app, "api", policy.Options{Cache: cache, Config: ratelimit.Config{OnFailure: ratelimit.FailError}})
	require.NoError(t, err)
	d, err := api.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(2), d.Limit)

	_, err = policy.SetOverride(ctx, owner, policy.Override{Policy: "api", Key: ratelimit.StoredKey(ratelimit.HashedKeys, "api", "k"), Limit: 7})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		d, err := api.Peek(ctx, "k")
		return err == nil && d.Limit == 7
	}, 2*time.Second, 10*time.Millisecond)
	x, err := policy.Explain(ctx, app, "api", "k")
	require.NoError(t, err)
	require.Equal(t, int64(1), x.Counter.Used)

	_, err = policy.Set(ctx, app, policy.Policy{Name: "api", Limit: 1000, Window: time.Hour})
	require.ErrorIs(t, err, policy.ErrPermission)
	require.ErrorContains(t, err, "migration role")
	require.ErrorIs(t, policy.Delete(ctx, app, "api"), policy.ErrPermission)
}
