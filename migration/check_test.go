package migration_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// Up checks every role of GrantTo before it does anything: a missing one is
// a *MissingRoleError (an ErrInvalidConfig) and the schema is not created.
func TestUpChecksGranteesFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	s := dbtest.NewSchema(t) + "_new"
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE")
	})
	role := dbtest.NewRole(t)
	for _, up := range []func(*migration.Migrator) error{
		func(m *migration.Migrator) error { _, err := m.Up(ctx); return err },
		func(m *migration.Migrator) error { _, err := m.UpTo(ctx, 1); return err },
	} {
		m := newMigrator(t, migration.Config{Schema: s, GrantTo: []string{role, "pgrl_no_such_role"}})
		err := up(m)
		require.ErrorIs(t, err, migration.ErrInvalidConfig)
		var mr *migration.MissingRoleError
		require.ErrorAs(t, err, &mr)
		require.Equal(t, []string{"pgrl_no_such_role"}, mr.Roles)
		require.Contains(t, err.Error(), `role "pgrl_no_such_role" does not exist, so nothing was done; create it first (CREATE ROLE "pgrl_no_such_role" LOGIN PASSWORD '...')`)
	}
	var exists bool
	require.NoError(t, admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s).Scan(&exists))
	require.False(t, exists, "nothing was done")
}

// Check: pending migrations are a *PendingError naming where it looked and
// what to run; a current schema passes; a dirty one is ErrDirty.
func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s, Table: "pgrl_other_migrations"})

	err := m.Check(ctx)
	require.ErrorIs(t, err, migration.ErrPending)
	require.ErrorIs(t, err, migration.ErrNotMigrated)
	var pe *migration.PendingError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, uint(0), pe.Version)
	require.Equal(t, migration.Available(), pe.Pending)
	require.Equal(t, "postgres", pe.User)
	require.Equal(t, "pgrl_test", pe.Database)
	require.Contains(t, err.Error(), "in database pgrl_test, schema "+s+" (looked in as user postgres): it is at version 0")
	require.Contains(t, err.Error(), "pending: 1 (counters), 2 (partitioning)")
	require.Contains(t, err.Error(), "run `rl-migrate --schema "+s+" --migrations-table pgrl_other_migrations up`")

	_, err = m.UpTo(ctx, 2)
	require.NoError(t, err)
	err = m.Check(ctx)
	require.ErrorAs(t, err, &pe)
	require.Equal(t, uint(2), pe.Version)
	require.Equal(t, migration.Available()[2:], pe.Pending)

	_, err = m.Up(ctx)
	require.NoError(t, err)
	require.NoError(t, m.Check(ctx))

	_, err = dbtest.Admin(t).Exec(ctx, "UPDATE "+pgx.Identifier{s, "pgrl_other_migrations"}.Sanitize()+" SET dirty = true")
	require.NoError(t, err)
	require.ErrorIs(t, m.Check(ctx), migration.ErrDirty)
}
