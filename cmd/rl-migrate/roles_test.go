package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// A name over 63 bytes is a usage error and nothing is done: PostgreSQL
// would cut it, and `down --all` on one schema then dropped another's tables.
func TestLongIdentifiersAreUsageErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	prefix := strings.Repeat("x", 55) + dbtest.NewSchema(t)[10:18] // 63 bytes, unique
	one, two := prefix+"_app_one", prefix+"_app_two"
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{prefix}.Sanitize()+" CASCADE")
	})

	for _, args := range [][]string{
		{"--database-url", dbtest.URL(), "--schema", one, "up"},
		{"--database-url", dbtest.URL(), "--schema", two, "down", "--all"},
		{"--database-url", dbtest.URL(), "--schema", one, "--output", "json", "status"},
		{"--database-url", dbtest.URL(), "--migrations-table", strings.Repeat("t", 64), "up"},
		{"--database-url", dbtest.URL(), "up", "--grant-to", strings.Repeat("r", 64)},
	} {
		stdout, stderr, code := runFn(t, args...)
		require.Equal(t, cli.ExitUsage, code, "%v: %s%s", args, stdout, stderr)
		require.Contains(t, stdout+stderr, "63 bytes", args)
	}
	var exists bool
	require.NoError(t, admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", prefix).Scan(&exists))
	require.False(t, exists, "no truncated schema was created")
}

// A width too narrow for the lookahead is a usage error at once, naming a
// width that works (the documented minimum of 1s once ran for minutes and
// exhausted the server's lock table).
func TestLayoutTooManyPartitionsIsUsageError(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	_, stderr, code := runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	start := time.Now()
	_, stderr, code = runFn(t, db(s, "layout", "partitioned", "--partition-width", "1s")...)
	require.Equal(t, cli.ExitUsage, code, stderr)
	require.Less(t, time.Since(start), 5*time.Second)
	require.Contains(t, stderr, "--partition-width 22m52s or wider")
	_, stderr, code = runFn(t, db(s, "layout", "partitioned", "--partition-width", "1m", "--lookahead", "2h")...)
	require.Equal(t, cli.ExitUsage, code, stderr)
	require.Contains(t, stderr, "at most 1h3m0s")
	stdout, stderr, code := runFn(t, db(s, "--output", "json", "layout", "partitioned", "--partition-width", "1m", "--lookahead", "30m")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(60), oneJSON(t, stdout)["partition_width_seconds"])
}

// up --grant-to gives the application role its rights (DML on the
// counters, SELECT only on the policy tables, the migrations table and the
// layout settings), on every run, and refuses a role that does not exist.
func TestUpGrantTo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	s := dbtest.NewSchema(t)
	app, worker := dbtest.NewRole(t), dbtest.NewRole(t)
	_, stderr, code := runFn(t, db(s, "up", "--grant-to", app)...)
	require.Equal(t, cli.ExitOK, code, stderr)

	can := func(role string) bool {
		var ok bool
		require.NoError(t, admin.QueryRow(ctx, `SELECT has_schema_privilege($1, $2, 'USAGE')
			AND has_table_privilege($1, $3, 'SELECT, INSERT, UPDATE, DELETE')
			AND has_table_privilege($1, $4, 'SELECT, INSERT, UPDATE, DELETE')
			AND has_table_privilege($1, $5, 'SELECT, INSERT, UPDATE, DELETE')
			AND has_function_privilege($1, $6, 'EXECUTE')
			AND NOT has_schema_privilege($1, $2, 'CREATE')
			AND NOT has_table_privilege($1, $3, 'TRUNCATE')
			AND has_table_privilege($1, $7, 'SELECT') AND NOT has_table_privilege($1, $7, 'INSERT, UPDATE, DELETE')
			AND has_table_privilege($1, $8, 'SELECT') AND NOT has_table_privilege($1, $8, 'INSERT, UPDATE, DELETE')
			AND has_table_privilege($1, $9, 'SELECT') AND NOT has_table_privilege($1, $9, 'INSERT, UPDATE, DELETE, TRUNCATE')
			AND has_table_privilege($1, $10, 'SELECT') AND NOT has_table_privilege($1, $10, 'INSERT, UPDATE, DELETE')`,
			role, s, s+".pgrl_fixed_window", s+".pgrl_token_bucket", s+".pgrl_sliding_window",
			pgx.Identifier{s}.Sanitize()+".pgrl_abort_unless(boolean, text)",
			s+".pgrl_policy", s+".pgrl_policy_override",
			s+"."+migration.DefaultTable, s+".pgrl_partition_settings").Scan(&ok))
		return ok
	}
	require.True(t, can(app))
	require.False(t, can(worker))

	// Nothing pending: the grants are still applied, to every role named.
	stdout, stderr, code := runFn(t, db(s, "--output", "json", "up", "--grant-to", app+","+worker)...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, false, oneJSON(t, stdout)["changed"])
	require.True(t, can(worker))

	_, stderr, code = runFn(t, db(s, "up", "--grant-to", "pgrl_no_such_role")...)
	require.Equal(t, cli.ExitUsage, code, stderr)
	require.Contains(t, stderr, `role "pgrl_no_such_role" does not exist`)
}

// The application role, with exactly what up --grant-to gives it, can ask
// whether its schema is current (status, status --check) and run a no-op
// up, which needs no CREATE; it is told what is pending, where, and what
// to run; and a role that may not read the migrations table is told the
// GRANT.
func TestAppRoleStatusCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	s := dbtest.NewSchema(t)
	owner, app, other := dbtest.NewRole(t), dbtest.NewRole(t), dbtest.NewRole(t)
	_, err := admin.Exec(ctx, "ALTER SCHEMA "+pgx.Identifier{s}.Sanitize()+" OWNER TO "+pgx.Identifier{owner}.Sanitize())
	require.NoError(t, err)
	as := func(role string, args ...string) (string, string, int) {
		return runFn(t, append([]string{"--database-url", dbtest.URLAs(role), "--schema", s}, args...)...)
	}
	_, stderr, code := as(owner, "up", "--grant-to", app)
	require.Equal(t, cli.ExitOK, code, stderr)

	stdout, stderr, code := as(app, "status")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "pending:          none")
	_, stderr, code = as(app, "status", "--check")
	require.Equal(t, cli.ExitOK, code, stderr)
	stdout, stderr, code = as(app, "--output", "json", "status", "--check")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, "plain", oneJSON(t, stdout)["layout"])
	stdout, stderr, code = as(app, "up")
	require.Equal(t, cli.ExitOK, code, "a no-op up needs no CREATE: %s", stderr)
	require.Contains(t, stdout, "nothing to do")

	// The partitioned layout: status reads the width too.
	_, stderr, code = as(owner, "layout", "partitioned")
	require.Equal(t, cli.ExitOK, code, stderr)
	stdout, stderr, code = as(app, "status", "--check")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "partitioned (partitions of 1h0m0s)")

	// One migration pending.
	prev := migration.Latest().Version - 1
	_, stderr, code = as(owner, "force", strconv.Itoa(int(prev)))
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = as(app, "status", "--check")
	require.Equal(t, cli.ExitPending, code, stderr)
	line := oneLine(t, stderr)
	for _, want := range []string{"database pgrl_test", "schema " + s, "as user " + app,
		fmt.Sprintf("pending: %d (%s)", migration.Latest().Version, migration.Latest().Name),
		"run `rl-migrate --schema " + s + " up` as the migration role"} {
		require.Contains(t, line, want)
	}
	_, stderr, code = as(app, "up")
	require.Equal(t, cli.ExitError, code, stderr)
	require.Contains(t, oneLine(t, stderr), "lacks CREATE on schema "+s)
	_, stderr, code = as(owner, "force", strconv.Itoa(int(migration.Latest().Version)))
	require.Equal(t, cli.ExitOK, code, stderr)

	// USAGE alone: the message names the GRANT.
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{s}.Sanitize()+" TO "+pgx.Identifier{other}.Sanitize())
	require.NoError(t, err)
	_, stderr, code = as(other, "status")
	require.Equal(t, cli.ExitError, code, stderr)
	line = oneLine(t, stderr)
	require.Contains(t, line, "lacks SELECT on "+s+"."+migration.DefaultTable)
	require.Contains(t, line, "GRANT SELECT ON TABLE "+pgx.Identifier{s, migration.DefaultTable}.Sanitize()+" TO "+pgx.Identifier{other}.Sanitize())
	require.Contains(t, line, "up --grant-to "+other)
}
