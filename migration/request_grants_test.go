package migration_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// Migration 000017 gives the roles that may check or clean up the counters
// the same rights on pgrl_request, so that an application role and a
// cleanup role set up before it keep working after it; a role with no
// right on the counters gets none.
func TestRequestTableInheritsGrants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: schema})
	_, err := m.UpTo(ctx, 16)
	require.NoError(t, err)
	app, cleaner, other := dbtest.NewRole(t), dbtest.NewRole(t), dbtest.NewRole(t)
	require.NoError(t, m.Grant(ctx, app))
	admin := dbtest.Admin(t)
	tbl := pgx.Identifier{schema, "pgrl_sliding_window"}.Sanitize()
	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON "+tbl+" TO "+pgx.Identifier{cleaner}.Sanitize())
	require.NoError(t, err)

	_, err = m.Up(ctx)
	require.NoError(t, err)
	req := pgx.Identifier{schema, "pgrl_request"}.Sanitize()
	for _, c := range []struct {
		role, privilege string
		want            bool
	}{
		{app, "SELECT", true}, {app, "INSERT", true}, {app, "UPDATE", true}, {app, "DELETE", true},
		{cleaner, "SELECT", true}, {cleaner, "DELETE", true}, {cleaner, "INSERT", false},
		{other, "SELECT", false},
	} {
		var got bool
		require.NoError(t, admin.QueryRow(ctx, "SELECT has_table_privilege($1, $2, $3)", c.role, req, c.privilege).Scan(&got))
		require.Equal(t, c.want, got, "%s %s on pgrl_request", c.role, c.privilege)
	}
}
