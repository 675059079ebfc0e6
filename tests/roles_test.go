package tests

// Least privilege: pgrl under the roles docs/SECURITY.md describes, each with
// exactly the documented rights and no more.

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
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

// roleSetup is one installation with its three roles.
type roleSetup struct {
	schema  string
	owner   string // migration role: owns pgrl's objects
	app     string // application role: granted by rl-migrate up --grant-to
	cleaner string // cleanup role
}

// newRoleSetup creates a schema owned by a fresh migration role, migrates it
// as that role with GrantTo naming a fresh application role, and creates a
// cleanup role with no rights yet.
func newRoleSetup(t *testing.T) roleSetup {
	t.Helper()
	ctx := context.Background()
	rs := roleSetup{schema: dbtest.NewSchema(t), owner: dbtest.NewRole(t), app: dbtest.NewRole(t), cleaner: dbtest.NewRole(t)}
	_, err := dbtest.Admin(t).Exec(ctx, "ALTER SCHEMA "+pgx.Identifier{rs.schema}.Sanitize()+" OWNER TO "+pgx.Identifier{rs.owner}.Sanitize())
	require.NoError(t, err)
	m := rs.migrator(t, migration.Config{GrantTo: []string{rs.app}})
	_, err = m.Up(ctx)
	require.NoError(t, err)
	return rs
}

// migrator is a Migrator connected as the migration role.
func (rs roleSetup) migrator(t *testing.T, cfg migration.Config) *migration.Migrator {
	t.Helper()
	cfg.Schema = rs.schema
	m, err := migration.New(dbtest.URLAs(rs.owner), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	return m
}

// poolAs is a pool connected as role with search_path set to the schema.
func (rs roleSetup) poolAs(t *testing.T, role string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), dbtest.URLAsWithSchema(role, rs.schema))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// Every algorithm, in both layouts, through every entry point a request can
// take, under the application role with exactly what `rl-migrate up
// --grant-to` gives it. A failure policy of FailError makes any missing
// right an error instead of a memory answer.
func TestRolesApplicationRoleNeedsOnlyTheGrants(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	app := rs.poolAs(t, rs.app)

	// The application role cannot change the schema.
	_, err := app.Exec(ctx, "CREATE TABLE pgrl_intruder (x int)")
	require.Error(t, err)

	// It may call pgrl_check (--grant-to grants EXECUTE) on a policy the
	// migration role stored (a day's window: the calls do not straddle
	// its end but once in tens of thousands).
	owner := rs.poolAs(t, rs.owner)
	_, err = owner.Exec(ctx, `INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('api', 2, '1 day')`)
	require.NoError(t, err)
	for i := range 3 {
		var allowed bool
		require.NoError(t, app.QueryRow(ctx, "SELECT allowed FROM pgrl_check('api', 'k')").Scan(&allowed))
		require.Equal(t, i < 2, allowed)
	}

	for _, layout := range []migration.Layout{migration.LayoutPlain, migration.LayoutPartitioned} {
		if layout == migration.LayoutPartitioned {
			// The switch replaces pgrl_fixed_window; the grants must follow.
			_, err := rs.migrator(t, migration.Config{}).SetLayout(ctx, layout, time.Hour)
			require.NoError(t, err)
		}
		var limiters []*ratelimit.Limiter
		limits := testkit.NewDatabase(t, app, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}) // the limits of one AllowAll
		for _, alg := range []ratelimit.Algorithm{ratelimit.FixedWindow, ratelimit.TokenBucket, ratelimit.SlidingWindow} {
			name := fmt.Sprintf("%s-%s", layout, alg)
			l, err := limits.Limiter(ratelimit.Config{Name: name, Algorithm: alg, Limit: 1000, Window: time.Minute, OnFailure: ratelimit.FailError, DenyCacheSize: -1})
			require.NoError(t, err, name)
			limiters = append(limiters, l)

			d, err := l.Allow(ctx, "k")
			require.NoError(t, err, name)
			require.Equal(t, ratelimit.StorePostgres, d.Store, name)
			require.True(t, d.Allowed, name)
			d, err = l.Allow(ctx, "k", ratelimit.UpTo(3))
			require.NoError(t, err, name)
			require.Equal(t, int64(3), d.Granted, name)
			_, err = l.Peek(ctx, "k")
			require.NoError(t, err, name)
			require.NoError(t, l.Reset(ctx, "k"), name)
			// Request ids and reservations: pgrl_request.
			_, err = l.Allow(ctx, "k", ratelimit.RequestID("once"))
			require.NoError(t, err, name)
			_, err = l.Reserve(ctx, "k", "job", 5)
			require.NoError(t, err, name)
			_, err = l.Settle(ctx, "k", "job", 2)
			require.NoError(t, err, name)

			tx, err := app.Begin(ctx)
			require.NoError(t, err)
			_, err = l.AllowTx(ctx, tx, "k", ratelimit.Cost(2))
			require.NoError(t, err, name)
			_, err = l.PeekTx(ctx, tx, "k")
			require.NoError(t, err, name)
			require.NoError(t, l.ResetTx(ctx, tx, "k"), name)
			require.NoError(t, tx.Commit(ctx))

			// Coalesced batches: many callers at once on one pool.
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for i := range 64 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					d, err := l.Allow(ctx, fmt.Sprintf("c%d", i%16))
					if err == nil && d.Store != ratelimit.StorePostgres {
						err = fmt.Errorf("answered by %s: %s", d.Store, d.Reason)
					}
					errs <- err
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err, name)
			}
		}
		for _, mode := range []ratelimit.MultiMode{ratelimit.AllOrNothing, ratelimit.ConsumeAll} {
			var checks []ratelimit.Check
			for _, l := range limiters {
				checks = append(checks, ratelimit.Check{Limiter: l, Key: "multi"})
			}
			md, err := ratelimit.AllowAll(ctx, mode, checks...)
			require.NoError(t, err, layout)
			require.True(t, md.Allowed, layout)
		}
	}
}

// rl-cleanup's two modes under the documented cleanup role: delete mode
// needs SELECT and DELETE on the counter tables; partitions mode creates and drops partitions,
// which takes the owner's rights: the cleanup role is a member of the
// migration role.
func TestRolesCleanupRoleBothModes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	admin := dbtest.Admin(t)
	s, c := pgx.Identifier{rs.schema}.Sanitize(), pgx.Identifier{rs.cleaner}.Sanitize()
	for _, stmt := range []string{
		"GRANT USAGE ON SCHEMA " + s + " TO " + c,
		"GRANT SELECT, DELETE ON " + s + ".pgrl_fixed_window, " + s + ".pgrl_token_bucket, " + s + ".pgrl_sliding_window, " +
			s + ".pgrl_request, " + s + ".pgrl_concurrency TO " + c,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	for _, tbl := range []string{"pgrl_fixed_window", "pgrl_sliding_window"} {
		_, err := admin.Exec(ctx, "INSERT INTO "+s+"."+tbl+" SELECT '\\x01', "+map[string]string{
			"pgrl_fixed_window":   "now() - interval '1 hour', 1, true",
			"pgrl_sliding_window": "now() - interval '3 hours', 1, 0, now() - interval '1 hour', true",
		}[tbl])
		require.NoError(t, err, tbl)
	}
	conn, err := pgx.Connect(ctx, dbtest.URLAsWithSchema(rs.cleaner, rs.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	res, err := cleanup.RunConn(ctx, conn, cleanup.Options{})
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Tables.FixedWindow.Deleted)
	require.Equal(t, int64(1), res.Tables.SlidingWindow.Deleted)

	// Partitions mode: without the owner's rights it fails, with them
	// (membership in the migration role) it works.
	_, err = rs.migrator(t, migration.Config{PartitionLookahead: 2 * time.Hour}).SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	_, err = cleanup.RunConn(ctx, conn, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 5 * time.Hour})
	require.Error(t, err, "creating partitions needs the owner's rights")
	_, err = admin.Exec(ctx, "GRANT "+pgx.Identifier{rs.owner}.Sanitize()+" TO "+c)
	require.NoError(t, err)
	res, err = cleanup.RunConn(ctx, conn, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 5 * time.Hour})
	require.NoError(t, err)
	require.GreaterOrEqual(t, res.Partitions.Created, 2)

	// The partitions it made belong to the migration role, like the rest.
	var others int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
		WHERE i.inhparent = to_regclass($1) AND pg_get_userbyid(c.relowner) <> $2`,
		rs.schema+".pgrl_fixed_window", rs.owner).Scan(&others))
	require.Zero(t, others)

	// And the application role still checks through the new partitions.
	app := rs.poolAs(t, rs.app)
	l, err := testkit.New(app, ratelimit.Config{Name: "after", Limit: 5, Window: 3 * time.Hour, OnFailure: ratelimit.FailError})
	require.NoError(t, err)
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
}

// A cleanup role without USAGE on the schema is told which grant is missing,
// not to run the migrations.
func TestRolesCleanupWithoutUsageNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	conn, err := pgx.Connect(ctx, dbtest.URLAsWithSchema(rs.cleaner, rs.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = cleanup.RunConn(ctx, conn, cleanup.Options{})
	require.ErrorIs(t, err, cleanup.ErrPermission)
	require.Contains(t, err.Error(), "GRANT USAGE ON SCHEMA")
	require.NotContains(t, err.Error(), "rl-migrate up")
}

// The application role, with exactly what GrantTo gives it, can guard its
// start-up: Status and Check read the migrations table (and the layout
// settings), and an Up with nothing pending succeeds without CREATE on the
// schema. When a migration is pending, Check says which and what to run, and
// Up asks for the migration role.
func TestRolesApplicationRoleChecksMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	asApp := func() *migration.Migrator {
		m, err := migration.New(dbtest.URLAs(rs.app), migration.Config{Schema: rs.schema})
		require.NoError(t, err)
		t.Cleanup(func() { _ = m.Close() })
		return m
	}
	for _, layout := range []migration.Layout{migration.LayoutPlain, migration.LayoutPartitioned} {
		_, err := rs.migrator(t, migration.Config{}).SetLayout(ctx, layout, time.Hour)
		require.NoError(t, err)
		app := asApp()
		st, err := app.Status(ctx)
		require.NoError(t, err, layout)
		require.Equal(t, layout, st.Layout)
		require.Empty(t, st.Pending)
		require.NoError(t, app.Check(ctx), layout)
		res, err := app.Up(ctx)
		require.NoError(t, err, "a no-op Up needs no CREATE (%s)", layout)
		require.False(t, res.Changed())
	}

	latest := migration.Latest()
	require.NoError(t, rs.migrator(t, migration.Config{}).Force(ctx, latest.Version-1))
	app := asApp()
	err := app.Check(ctx)
	require.ErrorIs(t, err, migration.ErrPending)
	require.ErrorIs(t, err, ratelimit.ErrNotMigrated)
	var pe *migration.PendingError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, []migration.Migration{latest}, pe.Pending)
	require.Equal(t, rs.app, pe.User)
	require.Contains(t, err.Error(), "rl-migrate --schema "+rs.schema+" up")
	_, err = app.Up(ctx)
	require.ErrorIs(t, err, migration.ErrPermission)
	require.Contains(t, err.Error(), "CREATE on schema "+rs.schema)
	require.NoError(t, rs.migrator(t, migration.Config{}).Force(ctx, latest.Version))

	// The cleanup role, which GrantTo did not name, is told the grant.
	_, err = dbtest.Admin(t).Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{rs.schema}.Sanitize()+" TO "+pgx.Identifier{rs.cleaner}.Sanitize())
	require.NoError(t, err)
	m, err := migration.New(dbtest.URLAs(rs.cleaner), migration.Config{Schema: rs.schema})
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	err = m.Check(ctx)
	require.ErrorIs(t, err, migration.ErrPermission)
	require.Contains(t, err.Error(), "GRANT SELECT ON TABLE "+pgx.Identifier{rs.schema, migration.DefaultTable}.Sanitize())
}

// docs/SECURITY.md's statements for the application role give exactly the
// rights that GrantTo (rl-migrate up --grant-to) gives, on every relation of
// the schema.
func TestRolesSecurityDocMatchesGrantTo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rs := newRoleSetup(t)
	admin := dbtest.Admin(t)
	body, err := os.ReadFile("../docs/SECURITY.md")
	require.NoError(t, err)
	doc := string(body)
	start := strings.Index(doc, "## 2. The application role")
	require.NotEqual(t, -1, start)
	block := regexp.MustCompile("(?s)```sql\n(.*?)```").FindStringSubmatch(doc[start:])
	require.NotNil(t, block)

	byDoc := dbtest.NewRole(t)
	sql := strings.ReplaceAll(block[1], "ratelimit.", pgx.Identifier{rs.schema}.Sanitize()+".")
	sql = strings.ReplaceAll(sql, "SCHEMA ratelimit", "SCHEMA "+pgx.Identifier{rs.schema}.Sanitize())
	sql = regexp.MustCompile(`\bTO app\b`).ReplaceAllString(sql, "TO "+pgx.Identifier{byDoc}.Sanitize())
	for _, stmt := range strings.Split(sql, ";") {
		stmt = strings.TrimSpace(stmt)
		if stmt == "" || strings.HasPrefix(stmt, "CREATE ROLE") {
			continue
		}
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	rights := func(role string) string {
		var s string
		require.NoError(t, admin.QueryRow(ctx, `
			SELECT has_schema_privilege($1, n.oid, 'USAGE')::text || has_schema_privilege($1, n.oid, 'CREATE')::text || ' ' ||
			       coalesce(string_agg(c.relname || ':' || (SELECT string_agg(p, ',' ORDER BY p) FROM unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE','REFERENCES','TRIGGER']) p
			                                                  WHERE has_table_privilege($1, c.oid, p)), ' ' ORDER BY c.relname), '')
			  FROM pg_namespace n LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p')
			 WHERE n.nspname = $2 GROUP BY n.oid`, role, rs.schema).Scan(&s))
		return s
	}
	require.Equal(t, rights(rs.app), rights(byDoc))
	require.Contains(t, rights(rs.app), migration.DefaultTable+":SELECT ")
}
