package migration_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// requireCitus skips the test unless the test database has the citus
// extension (the Citus leg of .ci/run: scripts/citus.sh).
func requireCitus(t *testing.T) {
	t.Helper()
	ok, err := migration.HasCitus(context.Background(), dbtest.Admin(t))
	require.NoError(t, err)
	if !ok {
		t.Skip("the test database has no citus extension (see scripts/citus.sh)")
	}
}

// requireDistributed asserts the distribution of every pgrl table in schema:
// the counters by key in one colocation group, the others reference tables.
func requireDistributed(t *testing.T, st migration.Status) {
	t.Helper()
	require.True(t, st.Citus)
	kinds := map[string]migration.Distribution{}
	for _, d := range st.Distribution {
		kinds[d.Table] = d
	}
	colocation := kinds["pgrl_token_bucket"].ColocationID
	require.NotZero(t, colocation)
	for _, table := range migration.DistributedTables {
		d := kinds[table]
		require.Equal(t, migration.DistributionDistributed, d.Kind, "%s: %s", table, d)
		require.Equal(t, "key", d.Column, table)
		require.Positive(t, d.Shards, table)
		require.Equal(t, colocation, d.ColocationID, "%s is colocated with the token bucket", table)
	}
	for _, table := range migration.ReferenceTables {
		require.Equal(t, migration.DistributionReference, kinds[table].Kind, table)
	}
	for _, table := range migration.CoordinatorTables {
		require.Equal(t, migration.DistributionLocal, kinds[table].Kind, table)
	}
}

// TestCitusUpDistributes: on Citus, up distributes the counters by key,
// colocated, and makes the configuration tables reference tables; a second
// up changes nothing; a layout switch, which builds a new fixed-window
// table, leaves it distributed, and so does the switch back.
func TestCitusUpDistributes(t *testing.T) {
	requireCitus(t)
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})

	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, append(append([]string{}, migration.DistributedTables...), migration.ReferenceTables...), res.Distributed)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	requireDistributed(t, st)

	res, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, res.Distributed, "a second up distributes nothing")
	require.False(t, res.Changed())

	pool := dbtest.PoolOn(t, s)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT int4send(i), now() + interval '10 minutes', i, true FROM generate_series(1, 20) i`)
	require.NoError(t, err)

	got, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPartitioned, got)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	requireDistributed(t, st)
	var n int64
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_fixed_window").Scan(&n))
	require.Equal(t, int64(20), n, "the live rows were copied")

	got, err = m.SetLayout(ctx, migration.LayoutPlain, 0)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPlain, got)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	requireDistributed(t, st)
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_fixed_window").Scan(&n))
	require.Equal(t, int64(20), n, "the live rows were copied back")
}

// TestCitusDbtestDistributes: the test helper distributes as up does, so
// that every test of this leg runs on distributed tables.
func TestCitusDbtestDistributes(t *testing.T) {
	requireCitus(t)
	_, s := dbtest.Pool(t)
	m := newMigrator(t, migration.Config{Schema: s})
	st, err := m.Status(context.Background())
	require.NoError(t, err)
	requireDistributed(t, st)
	again, err := migration.Distribute(context.Background(), dbtest.Admin(t), s)
	require.NoError(t, err)
	require.Empty(t, again)
	require.Equal(t, len(migration.StepFunctions), pinnedSteps(t, s), "the step functions are pinned to the schema")
}

// pinnedSteps counts the StepFunctions in schema s that have a search_path
// of their own.
func pinnedSteps(t *testing.T, s string) int {
	var n int
	require.NoError(t, dbtest.Admin(t).QueryRow(context.Background(), `
SELECT count(*) FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
 WHERE n.nspname = $1 AND p.proname = ANY ($2) AND p.proconfig @> ARRAY['search_path=' || quote_ident($1)]`,
		s, migration.StepFunctions).Scan(&n))
	return n
}

// TestDistributeWithoutCitusDoesNothing: on plain PostgreSQL every table is
// local and Distribute changes nothing.
func TestDistributeWithoutCitusDoesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if ok, err := migration.HasCitus(ctx, dbtest.Admin(t)); err != nil || ok {
		t.Skip("the test database has the citus extension")
	}
	_, s := dbtest.Pool(t)
	changed, err := migration.Distribute(ctx, dbtest.Admin(t), s)
	require.NoError(t, err)
	require.Empty(t, changed)
	ds, err := migration.Distributions(ctx, dbtest.Admin(t), s)
	require.NoError(t, err)
	require.Len(t, ds, len(migration.DistributedTables)+len(migration.ReferenceTables)+len(migration.CoordinatorTables))
	for _, d := range ds {
		require.Equal(t, migration.DistributionLocal, d.Kind, d.Table)
	}
	require.Zero(t, pinnedSteps(t, s), "without Citus the step functions stay inlinable")
}
