package migration_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// Status and Check as a role that lacks USAGE on the migrated schema, then
// SELECT on the migrations table, name the grant; the error is the
// ErrPermission of every package, never "pending" or "not migrated".
func TestStatusNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	owner, err := migration.New(dbtest.URL(), migration.Config{Schema: s})
	require.NoError(t, err)
	_, err = owner.Up(ctx)
	require.NoError(t, err)
	require.NoError(t, owner.Close())
	role := dbtest.NewRole(t)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	m, err := migration.New(dbtest.URLAs(role), migration.Config{Schema: s})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	expect := func(what, grant string) {
		t.Helper()
		_, err := m.Status(ctx)
		for i, err := range []error{err, m.Check(ctx)} {
			require.ErrorIs(t, err, migration.ErrPermission, "%s %d", what, i)
			require.ErrorIs(t, err, ratelimit.ErrPermission, "%s %d", what, i)
			require.NotErrorIs(t, err, migration.ErrNotMigrated, "%s %d", what, i)
			require.Contains(t, err.Error(), grant, "%s %d", what, i)
		}
	}
	expect("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	_, err = dbtest.Admin(t).Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	expect("USAGE without SELECT", "GRANT SELECT ON TABLE "+schema+"."+pgx.Identifier{migration.DefaultTable}.Sanitize()+" TO "+roleID)
}
