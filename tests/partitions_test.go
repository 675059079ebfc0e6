package tests

// The partitioned layout: bounded partition creation, width changes, no DDL
// in the request path, and installations in two schemas that never wait on
// each other.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// migrated returns a schema migrated by the migration package (as the test
// database's superuser) and a migrator on it.
func migrated(t *testing.T, cfg migration.Config) (string, *migration.Migrator) {
	t.Helper()
	s := dbtest.NewSchema(t)
	cfg.Schema = s
	m, err := migration.New(dbtest.URL(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	_, err = m.Up(context.Background())
	require.NoError(t, err)
	return s, m
}

type bound struct {
	name         string
	lower, upper time.Time
}

func partitionBounds(t *testing.T, schemaName string) []bound {
	t.Helper()
	rows, err := dbtest.Admin(t).Query(context.Background(), `SELECT partition_name::text, lower_bound, upper_bound
		FROM `+pgx.Identifier{schemaName}.Sanitize()+`.pgrl_fixed_window_partition_bounds(to_regclass($1))
		ORDER BY lower_bound`, pgx.Identifier{schemaName, "pgrl_fixed_window"}.Sanitize())
	require.NoError(t, err)
	var out []bound
	for rows.Next() {
		var b bound
		require.NoError(t, rows.Scan(&b.name, &b.lower, &b.upper))
		out = append(out, b)
	}
	require.NoError(t, rows.Err())
	return out
}

// Changing the width of a partitioned table: existing partitions keep their
// ranges, new ones start where they end, and partition-mode cleanup keeps
// working (it failed with 42P17 "would overlap").
func TestPartitionWidthChangeKeepsBounds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, m := migrated(t, migration.Config{PartitionLookahead: time.Hour})
	_, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	pool := dbtest.PoolOn(t, s)
	_, err = cleanup.Run(ctx, pool, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 3 * time.Hour})
	require.NoError(t, err)
	before := partitionBounds(t, s)

	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, 5*time.Minute)
	require.NoError(t, err)
	res, err := cleanup.Run(ctx, pool, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 5 * time.Hour})
	require.NoError(t, err, "cleanup after a width change")
	require.Greater(t, res.Partitions.Created, 0)

	after := partitionBounds(t, s)
	require.Equal(t, before, after[:len(before)], "old partitions keep their ranges")
	for i := 1; i < len(after); i++ {
		require.Equal(t, after[i-1].upper, after[i].lower, "no gap, no overlap at %s", after[i].name)
	}
	for _, b := range after[len(before):] {
		require.LessOrEqual(t, b.upper.Sub(b.lower), 5*time.Minute, b.name)
	}
	require.True(t, after[len(after)-1].upper.After(time.Now().Add(5*time.Hour-time.Minute)))

	// And back to a wider width: the first new partition is shorter, up to
	// the next multiple of the new width.
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	_, err = cleanup.Run(ctx, pool, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 7 * time.Hour})
	require.NoError(t, err)
	final := partitionBounds(t, s)
	for i := 1; i < len(final); i++ {
		require.Equal(t, final[i-1].upper, final[i].lower, "no gap, no overlap at %s", final[i].name)
	}
	require.Zero(t, final[len(final)-1].upper.Unix()%3600, "back on the hour grid")
}

// An Options.Horizon (how far ahead partitions are made) that would need
// more than MaxPartitionsAhead partitions is refused before anything is made.
func TestPartitionCleanupRefusesHorizonTooFar(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, m := migrated(t, migration.Config{PartitionLookahead: 30 * time.Minute})
	_, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Minute)
	require.NoError(t, err)
	before := len(partitionBounds(t, s))
	_, err = cleanup.Run(ctx, dbtest.PoolOn(t, s), cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 3 * time.Hour})
	require.ErrorIs(t, err, cleanup.ErrInvalidOptions)
	require.Contains(t, err.Error(), "--partition-width 2m52s")
	require.Equal(t, before, len(partitionBounds(t, s)))
}

// countDDL installs an event trigger that counts the DDL commands run by
// role, and returns a function reading the count. Event triggers are
// database-wide: it only counts for that role, so other tests' DDL is left
// alone.
func countDDL(t *testing.T, role string) func() int {
	t.Helper()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	s := dbtest.NewSchema(t)
	fn := pgx.Identifier{s, "count_ddl"}.Sanitize()
	trig := pgx.Identifier{"pgrl_test_ddl_" + s[len("pgrl_test_"):]}.Sanitize()
	for _, stmt := range []string{
		"CREATE TABLE " + pgx.Identifier{s, "ddl"}.Sanitize() + " (tag text)",
		"GRANT USAGE ON SCHEMA " + pgx.Identifier{s}.Sanitize() + " TO PUBLIC",
		"GRANT INSERT ON " + pgx.Identifier{s, "ddl"}.Sanitize() + " TO PUBLIC",
		`CREATE FUNCTION ` + fn + `() RETURNS event_trigger LANGUAGE plpgsql AS $$
		 BEGIN
		     IF current_user = ` + "'" + role + "'" + ` THEN
		         INSERT INTO ` + pgx.Identifier{s, "ddl"}.Sanitize() + ` VALUES (tg_tag);
		     END IF;
		 END $$`,
		"CREATE EVENT TRIGGER " + trig + " ON ddl_command_start EXECUTE FUNCTION " + fn + "()",
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP EVENT TRIGGER IF EXISTS "+trig) })
	return func() int {
		var n int
		require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{s, "ddl"}.Sanitize()).Scan(&n))
		return n
	}
}

// A fixed-window check whose window ends past the partitions made ahead
// never runs DDL from the request path: by default it gets ErrNoPartition
// (not a failure-policy answer); after EnsurePartitions at start-up it
// decides in PostgreSQL; with CreatePartitions it makes the partition itself.
// The checks run as the tables' owner, who could run DDL, to show that
// none is issued.
func TestPartitionCheckIssuesNoDDL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	_, err := rs.migrator(t, migration.Config{PartitionLookahead: time.Hour}).SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	ddl := countDDL(t, rs.owner)
	owner := rs.poolAs(t, rs.owner)

	// A window that ends past the partitions made ahead (the 1-hour
	// lookahead rounded up to the 1-hour width: at most 2 hours from now).
	// Windows are aligned on the Unix epoch, so a fixed length (6 hours, say)
	// ends within the lookahead for part of every day: pick one that does not
	// now.
	longWindow := windowEndingAfter(t, time.Now().Add(3*time.Hour), 6*time.Hour)
	cfg := ratelimit.Config{Name: "long", Limit: 3, Window: longWindow} // default policy: memory
	l, err := testkit.New(owner, cfg)
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrNoPartition)
	require.Contains(t, err.Error(), "rl-cleanup --partitions")
	tx, err := owner.Begin(ctx)
	require.NoError(t, err)
	_, err = l.AllowTx(ctx, tx, "k")
	require.ErrorIs(t, err, ratelimit.ErrNoPartition)
	require.NoError(t, tx.Rollback(ctx))
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrNoPartition)
	require.Zero(t, ddl(), "no DDL from the request path")

	// The application role's checks fail the same way, never as an outage.
	app := rs.poolAs(t, rs.app)
	la, err := testkit.New(app, cfg)
	require.NoError(t, err)
	_, err = la.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrNoPartition)

	// Start-up: make the partitions the declared limiters need.
	require.NoError(t, ratelimit.EnsurePartitions(ctx, owner, l))
	made := ddl()
	require.Greater(t, made, 0)
	for i := range 4 {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.Equal(t, i < 3, d.Allowed, "check %d", i)
	}
	d, err := la.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.False(t, d.Allowed, "one counter for both roles")
	require.Equal(t, made, ddl(), "checks issued no DDL")

	// A window that spans more than 63 partitions is refused up front.
	wide, err := testkit.New(owner, ratelimit.Config{Name: "wide", Limit: 3, Window: 100 * time.Hour})
	require.NoError(t, err)
	require.ErrorIs(t, ratelimit.EnsurePartitions(ctx, owner, wide), ratelimit.ErrPartitionWidth)

	// Opting in: the check creates its partition (its window ends past the
	// ones EnsurePartitions made for "long", which reach a whole window of
	// "long" ahead of now, plus a partition).
	optWindow := windowEndingAfter(t, time.Now().Add(longWindow+3*time.Hour), longWindow)
	opt, err := testkit.New(owner, ratelimit.Config{Name: "opt", Limit: 3, Window: optWindow}, ratelimit.DatabaseOptions{CreatePartitions: true})
	require.NoError(t, err)
	d, err = opt.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Greater(t, ddl(), made)
}

// windowEnd is when the fixed window of length w holding now ends: windows
// are aligned on the Unix epoch.
func windowEnd(now time.Time, w time.Duration) time.Time {
	us := w.Microseconds()
	return time.UnixMicro((now.UnixMicro()/us + 1) * us)
}

// windowEndingAfter returns the shortest whole number of hours, at least
// min, whose fixed window holding now ends after after, and at most 60
// hours so that it spans fewer partitions than one check may make.
func windowEndingAfter(t *testing.T, after time.Time, min time.Duration) time.Duration {
	t.Helper()
	for w := min.Truncate(time.Hour); w <= 60*time.Hour; w += time.Hour {
		if w >= min && windowEnd(time.Now(), w).After(after) {
			return w
		}
	}
	t.Fatalf("no window of %s to 60h ends after %s", min, after)
	return 0
}

// holdAdvisory runs stmt on a connection of its own inside a transaction
// that stays open until the test ends, holding whatever advisory lock stmt
// takes.
func holdAdvisory(t *testing.T, schemaName, stmt string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbtest.URLWithSchema(schemaName))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "BEGIN")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, stmt)
	require.NoError(t, err, stmt)
}

// Two installations in two schemas of one database: with every advisory
// lock pgrl takes held in schema A (the migration lock, golang-migrate's
// lock, the cleanup lock, the partition-creation lock), migrations, layout
// switches, partition creation and cleanups in schema B go ahead without
// waiting; and both schemas' work runs at once.
func TestPartitionTwoSchemasShareNoAdvisoryLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, ma := migrated(t, migration.Config{})
	_, err := ma.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	b := dbtest.NewSchema(t)

	// Every advisory lock pgrl takes, held for schema A.
	holdAdvisory(t, a, "SELECT pg_advisory_lock(hashtextextended(current_database() || '/' || $$pgrl-migrate/"+a+"/"+migration.DefaultTable+"$$, 0))")
	holdAdvisory(t, a, "SELECT pg_advisory_xact_lock(hashtext('pgrl_cleanup')::bigint << 32 | (SELECT c.relnamespace::bigint FROM pg_class c WHERE c.oid = 'pgrl_fixed_window'::regclass))")
	holdAdvisory(t, a, "SELECT pgrl_fixed_window_ensure_partitions(now(), now() + interval '30 hours')")

	var held []string
	rows, err := dbtest.Admin(t).Query(ctx, "SELECT classid::text || '/' || objid::text FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()")
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		held = append(held, k)
	}
	require.NoError(t, rows.Err())
	require.GreaterOrEqual(t, len(held), 3)

	bounded := func(name string, fn func(ctx context.Context) error) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		require.NoError(t, fn(cctx), name)
	}
	mb, err := migration.New(dbtest.URL(), migration.Config{Schema: b, LockWait: 2 * time.Second, LockTimeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = mb.Close() })
	bounded("migrate B", func(ctx context.Context) error { _, err := mb.Up(ctx); return err })
	bounded("layout B", func(ctx context.Context) error {
		_, err := mb.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
		return err
	})
	poolB := dbtest.PoolOn(t, b)
	bounded("ensure partitions B", func(ctx context.Context) error {
		_, err := poolB.Exec(ctx, "SET lock_timeout = '2s'; SELECT pgrl_fixed_window_ensure_partitions(now(), now() + interval '30 hours')")
		return err
	})
	bounded("cleanup B", func(ctx context.Context) error {
		res, err := cleanup.Run(ctx, poolB, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 40 * time.Hour, LockTimeout: 2 * time.Second})
		if err == nil && res.Skipped {
			err = errors.New("skipped: waited on A's cleanup lock")
		}
		return err
	})
}

// Migrations, layout switches and cleanups in two schemas at the same time
// all succeed.
func TestPartitionTwoSchemasAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schemas := []string{dbtest.NewSchema(t), dbtest.NewSchema(t)}
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(schemas))
	for _, s := range schemas {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := migration.New(dbtest.URL(), migration.Config{Schema: s})
			if err != nil {
				errs <- err
				return
			}
			defer func() { _ = m.Close() }()
			if _, err := m.Up(ctx); err != nil {
				errs <- fmt.Errorf("%s up: %w", s, err)
				return
			}
			pool, err := pgxpool.New(ctx, dbtest.URLWithSchema(s))
			if err != nil {
				errs <- err
				return
			}
			defer pool.Close()
			for _, w := range []time.Duration{time.Hour, 30 * time.Minute, time.Hour} {
				if _, err := m.SetLayout(ctx, migration.LayoutPartitioned, w); err != nil {
					errs <- fmt.Errorf("%s layout %s: %w", s, w, err)
					return
				}
				res, err := cleanup.Run(ctx, pool, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 24 * time.Hour})
				if err == nil && res.Skipped {
					err = errors.New("skipped")
				}
				if err != nil {
					errs <- fmt.Errorf("%s cleanup: %w", s, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// The packages that bound partition creation agree on the bound and on the
// default lookahead.
func TestPartitionBoundsAgree(t *testing.T) {
	t.Parallel()
	require.Equal(t, migration.MaxPartitions, cleanup.MaxPartitionsAhead)
	require.Equal(t, migration.DefaultPartitionLookahead, cleanup.DefaultHorizon)
}
