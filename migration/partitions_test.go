package migration_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// countPartitions counts the partitions of pgrl_fixed_window in schemaName.
func countPartitions(t *testing.T, schemaName string) int {
	t.Helper()
	var n int
	require.NoError(t, dbtest.Admin(t).QueryRow(context.Background(),
		`SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)`,
		pgx.Identifier{schemaName, "pgrl_fixed_window"}.Sanitize()).Scan(&n))
	return n
}

// A width that would need more than MaxPartitions partitions for the
// lookahead is refused before anything is done (it once made 3,600
// partitions in one transaction and exhausted the server's lock table).
func TestSetLayoutRefusesTooManyPartitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s, LockTimeout: 2 * time.Second})
	_, err := m.Up(ctx)
	require.NoError(t, err)

	start := time.Now()
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Minute) // 24h lookahead: 1,441 partitions
	require.Less(t, time.Since(start), 10*time.Second)
	var pc *migration.PartitionCountError
	require.ErrorAs(t, err, &pc, "%v", err)
	require.ErrorIs(t, err, migration.ErrInvalidConfig)
	require.ErrorIs(t, err, migration.ErrTooManyPartitions)
	require.Contains(t, err.Error(), "--partition-width 22m52s")
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPlain, st.Layout, "nothing changed")

	// The same width with a lookahead it can cover works, and makes no more
	// than MaxPartitions partitions.
	m2 := newMigrator(t, migration.Config{Schema: s, PartitionLookahead: 30 * time.Minute})
	got, err := m2.SetLayout(ctx, migration.LayoutPartitioned, time.Minute)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPartitioned, got)
	n := countPartitions(t, s)
	require.GreaterOrEqual(t, n, 31)
	require.LessOrEqual(t, n, migration.MaxPartitions)
}

// Live rows whose windows reach further than MaxPartitions widths make the
// switch fail with a typed error naming a wider width, leaving the plain
// table and its rows as they were.
func TestSetLayoutRefusesLiveWindowsTooFar(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s, PartitionLookahead: 10 * time.Minute})
	_, err := m.Up(ctx)
	require.NoError(t, err)
	admin := dbtest.Admin(t)
	_, err = admin.Exec(ctx, "INSERT INTO "+pgx.Identifier{s, "pgrl_fixed_window"}.Sanitize()+
		" VALUES ('\\x01', now() + interval '1 day', 3, true)")
	require.NoError(t, err)

	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Minute)
	require.ErrorIs(t, err, migration.ErrTooManyPartitions, "%v", err)
	require.Contains(t, err.Error(), "partition width of at least")
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPlain, st.Layout)
	var rows int
	require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{s, "pgrl_fixed_window"}.Sanitize()).Scan(&rows))
	require.Equal(t, 1, rows)
}

// A layout switch does not queue behind a long transaction on the table.
func TestSetLayoutDoesNotQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s, LockTimeout: 200 * time.Millisecond})
	_, err := m.Up(ctx)
	require.NoError(t, err)
	tx, err := dbtest.PoolOn(t, s).Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(ctx, "SELECT count(*) FROM pgrl_fixed_window")
	require.NoError(t, err)
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.Error(t, err)
	require.Contains(t, err.Error(), "lock timeout")
	require.NoError(t, tx.Rollback(ctx))
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPlain, st.Layout)
	require.Equal(t, 0, countPartitions(t, s))
}

// Names PostgreSQL would truncate are refused before anything is done: two
// schemas whose first 63 bytes agree would otherwise be one.
func TestIdentifiersLongerThan63BytesRefused(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("s", 63) + "_app_one"
	for _, cfg := range []migration.Config{
		{Schema: long},
		{Table: strings.Repeat("t", 64)},
		{GrantTo: []string{strings.Repeat("r", 64)}},
		{Schema: "a\x00b"},
		{Table: "schema_migrations"},
	} {
		_, err := migration.New(dbtest.URL(), cfg)
		require.ErrorIs(t, err, migration.ErrInvalidConfig, "%+v", cfg)
	}
	_, err := migration.New(dbtest.URL(), migration.Config{Schema: strings.Repeat("s", 63)})
	require.NoError(t, err, "63 bytes is PostgreSQL's limit and fine")
}

// A user who may not create objects in the schema is told which grant is
// missing, not to run the migrations.
func TestPermissionErrorNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	owner := newMigrator(t, migration.Config{Schema: s})
	_, err := owner.Up(ctx)
	require.NoError(t, err)
	role := dbtest.NewRole(t)

	m, err := migration.New(dbtest.URLAs(role), migration.Config{Schema: s, LockWait: 5 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	for name, op := range map[string]func() error{
		"status": func() error { _, err := m.Status(ctx); return err },
		"up":     func() error { _, err := m.Up(ctx); return err },
		"layout": func() error { _, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour); return err },
	} {
		err := op()
		var pe *migration.PermissionError
		require.ErrorAs(t, err, &pe, "%s: %v", name, err)
		require.ErrorIs(t, err, migration.ErrPermission)
		require.Contains(t, err.Error(), "GRANT USAGE ON SCHEMA", name)
		require.NotContains(t, err.Error(), "rl-migrate up", name)
	}

	_, err = dbtest.Admin(t).Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{s}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.ErrorIs(t, err, migration.ErrPermission)
	require.Contains(t, err.Error(), "ownership of "+s+".pgrl_fixed_window")
	_, err = m.Up(ctx)
	require.ErrorIs(t, err, migration.ErrPermission)
	require.Contains(t, err.Error(), "GRANT CREATE ON SCHEMA")
	require.True(t, errors.Is(err, migration.ErrPermission))
}
