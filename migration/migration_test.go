package migration_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

func newMigrator(t *testing.T, cfg migration.Config) *migration.Migrator {
	t.Helper()
	m, err := migration.New(dbtest.URL(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return m
}

func TestAvailableAndSQL(t *testing.T) {
	t.Parallel()
	all := migration.Available()
	require.GreaterOrEqual(t, len(all), 2)
	require.Equal(t, migration.Migration{Version: 1, Name: "counters"}, all[0])
	require.Equal(t, migration.Migration{Version: 2, Name: "partitioning"}, all[1])
	for i, m := range all {
		require.Equal(t, uint(i+1), m.Version, "versions are consecutive")
		_, err := migration.SQL(m.Version, migration.Down)
		require.NoError(t, err, "every migration has a down file")
	}
	require.Equal(t, all[len(all)-1], migration.Latest())
	require.Equal(t, "000002_partitioning", all[1].String())

	up, err := migration.SQL(1, migration.Up)
	require.NoError(t, err)
	require.Contains(t, up, "CREATE UNLOGGED TABLE pgrl_fixed_window")
	down, err := migration.SQL(1, migration.Down)
	require.NoError(t, err)
	require.Contains(t, down, "DROP TABLE IF EXISTS pgrl_fixed_window")

	_, err = migration.SQL(999, migration.Up)
	require.ErrorIs(t, err, migration.ErrUnknownVersion)
	require.Contains(t, err.Error(), "no pgrl migration has version 999; available versions: 1 (counters), 2 (partitioning)")
	_, err = migration.SQL(1, "sideways")
	require.Error(t, err)
}

func TestNewRefusesGolangMigrateDefaultTable(t *testing.T) {
	t.Parallel()
	_, err := migration.New(dbtest.URL(), migration.Config{Table: "schema_migrations"})
	require.ErrorContains(t, err, "golang-migrate's default table")
	_, err = migration.New(dbtest.URL(), migration.Config{LockTimeout: -time.Second})
	require.Error(t, err)
}

// requireCounterTables checks that every pgrl counter table (and every
// partition of one) in the schema is UNLOGGED with a fillfactor of at most
// 70, and that the three tables exist. It returns the number of partitions.
func requireCounterTables(t *testing.T, schemaName string) int {
	t.Helper()
	rows, err := dbtest.Admin(t).Query(context.Background(), `
		SELECT c.relname, c.relkind::text, c.relpersistence::text, c.relispartition,
		       coalesce((SELECT split_part(o, '=', 2)::int FROM unnest(c.reloptions) o WHERE o LIKE 'fillfactor=%'), 100)
		  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = $1 AND c.relname LIKE 'pgrl\_%' AND c.relkind IN ('r', 'p')
		   AND c.relname NOT IN ('pgrl_schema_migrations', 'pgrl_partition_settings', 'pgrl_policy', 'pgrl_policy_override')`, schemaName)
	require.NoError(t, err)
	type rel struct {
		name, kind, persistence string
		partition               bool
		fillfactor              int
	}
	rels, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (rel, error) {
		var x rel
		err := r.Scan(&x.name, &x.kind, &x.persistence, &x.partition, &x.fillfactor)
		return x, err
	})
	require.NoError(t, err)
	seen := map[string]bool{}
	partitions := 0
	for _, r := range rels {
		seen[r.name] = true
		if r.kind == "p" { // a partitioned parent stores nothing itself
			continue
		}
		if r.partition {
			partitions++
		}
		require.Equal(t, "u", r.persistence, "%s must be UNLOGGED", r.name)
		if r.name == "pgrl_request" {
			continue // written once per request, never updated: no room kept for HOT updates
		}
		require.LessOrEqual(t, r.fillfactor, 70, "%s fillfactor", r.name)
	}
	for _, name := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
		require.True(t, seen[name], "table %s missing from %v", name, rels)
	}
	return partitions
}

// objects lists the tables, sequences, views and functions in the schema.
func objects(t *testing.T, schemaName string) []string {
	t.Helper()
	rows, err := dbtest.Admin(t).Query(context.Background(), `
		SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
		UNION ALL
		SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1
		ORDER BY 1`, schemaName)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

func TestUpCreatesUnloggedTablesAndRoundTrips(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})

	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, uint(0), res.From)
	require.Equal(t, migration.Latest().Version, res.To)
	require.Equal(t, migration.Available(), res.Applied)
	require.Equal(t, 0, requireCounterTables(t, s))

	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.Latest().Version, st.Version)
	require.False(t, st.Dirty)
	require.Empty(t, st.Pending)
	require.Equal(t, migration.LayoutPlain, st.Layout)

	// Nothing pending: success, no change.
	res, err = m.Up(ctx)
	require.NoError(t, err)
	require.False(t, res.Changed())

	res, err = m.DownAll(ctx)
	require.NoError(t, err)
	all := migration.Available()
	require.Len(t, res.Reverted, len(all))
	for i, m := range res.Reverted {
		require.Equal(t, all[len(all)-1-i], m, "reverted newest first")
	}
	require.Equal(t, []string{migration.DefaultTable}, objects(t, s))

	// Down with nothing applied is a no-op.
	res, err = m.Down(ctx, 1)
	require.NoError(t, err)
	require.False(t, res.Changed())

	_, err = m.Up(ctx)
	require.NoError(t, err)
	requireCounterTables(t, s)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.Empty(t, st.Pending)
	require.Equal(t, migration.Available(), st.Applied)
}

func TestUpToAndDownSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})

	_, err := m.UpTo(ctx, 999)
	require.ErrorIs(t, err, migration.ErrUnknownVersion)

	res, err := m.UpTo(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, uint(1), res.To)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.Available()[1:], st.Pending)

	_, err = m.UpTo(ctx, 2)
	require.NoError(t, err)
	_, err = m.UpTo(ctx, 1)
	require.ErrorContains(t, err, "never reverts")

	res, err = m.Down(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, uint(1), res.To)
	require.Equal(t, []migration.Migration{migration.Available()[1]}, res.Reverted)
	// More steps than applied migrations: reverts what there is.
	res, err = m.Down(ctx, 5)
	require.NoError(t, err)
	require.Equal(t, uint(0), res.To)
	_, err = m.Down(ctx, 0)
	require.Error(t, err)
}

func TestSchemaDefaultsToSearchPathAndIsCreated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m, err := migration.New(dbtest.URLWithSchema(s), migration.Config{})
	require.NoError(t, err)
	defer m.Close()
	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, s, res.Schema)
	requireCounterTables(t, s)

	// A named schema that does not exist yet is created.
	fresh := s + "_new"
	t.Cleanup(func() {
		_, _ = dbtest.Admin(t).Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{fresh}.Sanitize()+" CASCADE")
	})
	m2 := newMigrator(t, migration.Config{Schema: fresh})
	st, err := m2.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.Available(), st.Pending, "status on a missing schema reports everything pending")
	_, err = m2.Up(ctx)
	require.NoError(t, err)
	requireCounterTables(t, fresh)
}

func TestLayoutSwitchKeepsLiveRowsAndUnloggedPartitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})

	_, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.ErrorIs(t, err, migration.ErrNotMigrated)

	_, err = m.Up(ctx)
	require.NoError(t, err)
	pool := dbtest.PoolOn(t, s)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed, updated_at, policy_limit, policy_penalty)
		SELECT int4send(i), now() + interval '10 minutes' + i * interval '1 minute', i, true, now(),
		       CASE WHEN i % 3 = 0 THEN 100 + i END, CASE WHEN i % 3 = 0 THEN i % 2 = 0 END
		  FROM generate_series(1, 50) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed) VALUES ('dead', now() - interval '1 hour', 9, false)`)
	require.NoError(t, err)
	// liveSum counts the live rows and reads every column of them, so that
	// a switch that lost a column (such as the policy figures of migration
	// 000013) shows. Two plain queries, which Citus runs on a distributed
	// table too.
	liveSum := func() (n int64, sum string) {
		var cols []string
		var desc string
		require.NoError(t, pool.QueryRow(ctx, `
SELECT array_agg(quote_ident(a.attname) ORDER BY a.attnum), string_agg(a.attname, ',' ORDER BY a.attnum)
  FROM pg_attribute AS a WHERE a.attrelid = 'pgrl_fixed_window'::regclass AND a.attnum > 0 AND NOT a.attisdropped`).Scan(&cols, &desc))
		rows, err := pool.Query(ctx, `SELECT concat_ws('|', `+strings.Join(cols, "::text, ")+`::text)
  FROM pgrl_fixed_window WHERE expires_at > now() ORDER BY key, expires_at`)
		require.NoError(t, err)
		all, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return int64(len(all)), desc + "\n" + strings.Join(all, "\n")
	}
	n0, sum0 := liveSum()
	require.Equal(t, int64(50), n0)

	got, err := m.SetLayout(ctx, migration.LayoutPartitioned, 30*time.Minute)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPartitioned, got)
	require.Greater(t, requireCounterTables(t, s), 0, "partitioned layout has partitions")
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPartitioned, st.Layout)
	require.Equal(t, 30*time.Minute, st.PartitionWidth)
	n, sum := liveSum()
	require.Equal(t, n0, n)
	require.Equal(t, sum0, sum)

	got, err = m.SetLayout(ctx, migration.LayoutPlain, 0)
	require.NoError(t, err)
	require.Equal(t, migration.LayoutPlain, got)
	require.Equal(t, 0, requireCounterTables(t, s))
	n, sum = liveSum()
	require.Equal(t, n0, n)
	require.Equal(t, sum0, sum)

	_, err = m.SetLayout(ctx, "sideways", 0)
	require.Error(t, err)
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Millisecond)
	require.Error(t, err)
}

func TestAppSchemaMigrationsTableUntouched(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	admin := dbtest.Admin(t)
	appTable := pgx.Identifier{s, "schema_migrations"}.Sanitize()
	_, err := admin.Exec(ctx, "CREATE TABLE "+appTable+" (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)")
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "INSERT INTO "+appTable+" VALUES (42, false)")
	require.NoError(t, err)

	m := newMigrator(t, migration.Config{Schema: s})
	_, err = m.Up(ctx)
	require.NoError(t, err)
	_, err = m.DownAll(ctx)
	require.NoError(t, err)

	var v int64
	var dirty bool
	var n int
	require.NoError(t, admin.QueryRow(ctx, "SELECT max(version), bool_or(dirty), count(*) FROM "+appTable).Scan(&v, &dirty, &n))
	require.Equal(t, int64(42), v)
	require.False(t, dirty)
	require.Equal(t, 1, n)
}

func TestDirtyStateNeedsForce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})
	_, err := m.UpTo(ctx, 1)
	require.NoError(t, err)
	_, err = dbtest.Admin(t).Exec(ctx, "UPDATE "+pgx.Identifier{s, migration.DefaultTable}.Sanitize()+" SET dirty = true")
	require.NoError(t, err)

	_, err = m.Up(ctx)
	require.ErrorIs(t, err, migration.ErrDirty)
	var de *migration.DirtyError
	require.True(t, errors.As(err, &de))
	require.Equal(t, uint(1), de.Version)
	require.Contains(t, err.Error(), "rl-migrate force 1")
	_, err = m.Down(ctx, 1)
	require.ErrorIs(t, err, migration.ErrDirty)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.True(t, st.Dirty)

	require.ErrorIs(t, m.Force(ctx, 999), migration.ErrUnknownVersion)
	require.NoError(t, m.Force(ctx, 1))
	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, migration.Latest().Version, res.To)
}

func TestDatabaseNewerThanBuild(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})
	_, err := m.Up(ctx)
	require.NoError(t, err)
	_, err = dbtest.Admin(t).Exec(ctx, "UPDATE "+pgx.Identifier{s, migration.DefaultTable}.Sanitize()+" SET version = 999")
	require.NoError(t, err)
	_, err = m.Up(ctx)
	var uv *migration.UnknownVersionError
	require.ErrorAs(t, err, &uv)
	require.True(t, uv.InDatabase)
	require.Contains(t, err.Error(), "newer rl-migrate")
}

// A migration that cannot get its locks within LockTimeout fails, leaves
// nothing behind and does not leave the table dirty.
func TestLockTimeoutRollsBackCleanly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s, LockTimeout: 200 * time.Millisecond})
	_, err := m.UpTo(ctx, 2)
	require.NoError(t, err)

	// A long transaction that has read pgrl_fixed_window.
	pool := dbtest.PoolOn(t, s)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(ctx, "SELECT count(*) FROM pgrl_fixed_window")
	require.NoError(t, err)

	start := time.Now()
	_, err = m.Down(ctx, 1) // 000002 down rebuilds pgrl_fixed_window: ACCESS EXCLUSIVE
	require.Less(t, time.Since(start), 5*time.Second)
	var fe *migration.FailedError
	require.ErrorAs(t, err, &fe, "%v", err)
	require.Equal(t, uint(2), fe.Migration.Version)
	require.Equal(t, uint(2), fe.Version)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "55P03", pgErr.Code)

	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.False(t, st.Dirty)
	require.Equal(t, uint(2), st.Version)

	require.NoError(t, tx.Rollback(ctx))
	res, err := m.Down(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, uint(1), res.To)
}

// Several migrators started together (as several instances of an app do)
// apply the migrations once.
func TestConcurrentUpInOneProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	const n = 4
	errs := make(chan error, n)
	changed := make(chan bool, n)
	start := make(chan struct{})
	for range n {
		m := newMigrator(t, migration.Config{Schema: s})
		go func() {
			<-start
			res, err := m.Up(ctx)
			errs <- err
			changed <- res.Changed()
		}()
	}
	close(start)
	applied := 0
	for range n {
		require.NoError(t, <-errs)
		if <-changed {
			applied++
		}
	}
	require.Equal(t, 1, applied)
	requireCounterTables(t, s)
}

func TestCancelledContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})
	_, err := m.Up(ctx)
	require.ErrorIs(t, err, context.Canceled)
	st, err := m.Status(context.Background())
	require.NoError(t, err)
	require.Equal(t, uint(0), st.Version)
}
