package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// A role whose search_path names pgrl's schema but that lacks USAGE on it,
// then SELECT on the policy tables, is told the grant it lacks by
// NewLimiter, Cache.Reload and the listener, never that tables are missing.
func TestPermissionNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, owner, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	app, err := pgxpool.New(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(app.Close)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()

	expect := func(what, grant string, pgErrCode string, err error) {
		t.Helper()
		require.ErrorIs(t, err, policy.ErrPermission, what)
		require.ErrorIs(t, err, ratelimit.ErrPermission, what)
		require.NotErrorIs(t, err, policy.ErrNotMigrated, what)
		require.NotContains(t, err.Error(), "tables are missing", what)
		require.Contains(t, err.Error(), grant, what)
		if pgErrCode != "" {
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr, what)
			require.Equal(t, pgErrCode, pgErr.Code, what)
		}
	}
	listen := func() error {
		t.Helper()
		l, err := policy.Watch(ctx, dbtest.URLAsWithSchema(role, s), policy.NewCache(app),
			policy.ListenerOptions{MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
		require.NoError(t, err)
		defer func() { require.NoError(t, l.Close()) }()
		require.Eventually(t, func() bool { return l.Stats().LastError != "" }, time.Minute, 5*time.Millisecond)
		done, cancel := context.WithCancel(ctx)
		cancel()
		err = l.WaitSynced(done)
		require.ErrorIs(t, err, context.Canceled)
		return err
	}
	check := func(stage, grant, code string) {
		t.Helper()
		_, err := newLimiter(ctx, app, "api", policy.Options{})
		expect(stage+": NewLimiter", grant, code, err)
		expect(stage+": Reload", grant, code, policy.NewCache(app).Reload(ctx))
		expect(stage+": listener", grant, code, listen())
	}
	// The package's other reads, from Go, are told the same.
	reads := func(stage, grant, code string) {
		t.Helper()
		_, err := policy.Get(ctx, app, "api")
		expect(stage+": Get", grant, code, err)
		_, err = policy.List(ctx, app)
		expect(stage+": List", grant, code, err)
		_, err = policy.ListOverrides(ctx, app, "api")
		expect(stage+": ListOverrides", grant, code, err)
		_, err = policy.Explain(ctx, app, "api", "k")
		expect(stage+": Explain", grant, code, err)
	}

	check("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID, "")
	reads("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID, "")
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	check("USAGE without SELECT", "GRANT SELECT ON "+schema+`."pgrl_policy", `+schema+`."pgrl_policy_override" TO `+roleID, "42501")
	reads("USAGE without SELECT", "GRANT SELECT ON "+schema+`."pgrl_policy", `+schema+`."pgrl_policy_override" TO `+roleID, "42501")
	_, err = admin.Exec(ctx, "GRANT SELECT ON "+schema+".pgrl_policy TO "+roleID)
	require.NoError(t, err)
	check("SELECT on one table", "GRANT SELECT ON "+schema+`."pgrl_policy_override" TO `+roleID, "42501")

	// With the grants the reads work; the write is refused with the
	// statement that would allow it.
	_, err = admin.Exec(ctx, "GRANT SELECT ON "+schema+`."pgrl_policy_override" TO `+roleID)
	require.NoError(t, err)
	_, err = newLimiter(ctx, app, "api", policy.Options{})
	require.NoError(t, err)
	_, err = policy.Set(ctx, app, policy.Policy{Name: "api", Limit: 1000, Window: time.Hour})
	expect("write", "GRANT SELECT, INSERT, UPDATE, DELETE ON", "42501", err)
	require.ErrorContains(t, err, "migration role")
}
