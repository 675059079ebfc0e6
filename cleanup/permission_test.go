package cleanup_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// A role whose search_path names pgrl's schema but that lacks USAGE on it,
// then SELECT and DELETE on the counters, is told the grant it lacks, never
// to run migrations; it is the ErrPermission of every package.
func TestRunNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, s := dbtest.Pool(t)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	app, err := pgxpool.New(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(app.Close)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	expect := func(what, grant string, err error) {
		t.Helper()
		require.ErrorIs(t, err, cleanup.ErrPermission, what)
		require.ErrorIs(t, err, ratelimit.ErrPermission, what)
		require.NotErrorIs(t, err, cleanup.ErrNotMigrated, what)
		require.NotContains(t, err.Error(), "tables are missing", what)
		require.Contains(t, err.Error(), grant, what)
	}
	_, err = cleanup.Run(ctx, app, cleanup.Options{})
	expect("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID, err)
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	_, err = cleanup.Run(ctx, app, cleanup.Options{})
	expect("USAGE without SELECT", "GRANT SELECT, DELETE ON "+schema+`."pgrl_fixed_window"`, err)
	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON ALL TABLES IN SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	_, err = cleanup.Run(ctx, app, cleanup.Options{})
	require.NoError(t, err)
}

// The schema without USAGE is found however search_path names it: quoted,
// with spaces, upper case, a comma inside.
func TestRunNamesTheGrantQuotedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t) + ` Rate, "Limits"`
	admin := dbtest.Admin(t)
	schema := pgx.Identifier{s}.Sanitize()
	_, err := admin.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	dbtest.Migrate(t, s)
	role := dbtest.NewRole(t)
	cfg, err := pgxpool.ParseConfig(dbtest.URLAs(role))
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	app, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(app.Close)
	_, err = cleanup.Run(ctx, app, cleanup.Options{})
	require.ErrorIs(t, err, cleanup.ErrPermission)
	require.NotErrorIs(t, err, cleanup.ErrNotMigrated)
	require.Contains(t, err.Error(), "GRANT USAGE ON SCHEMA "+schema+" TO "+pgx.Identifier{role}.Sanitize())
}
