package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// Flag errors name the flag as the help does (two dashes), once, without the
// command's name in front, and a bad duration gets examples instead of the
// flag package's "parse error".
func TestFlagErrorsReadCleanly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"up", "--grant-to"}, "rl-migrate: flag --grant-to needs an argument, such as --grant-to app; "},
		{[]string{"--schema"}, "rl-migrate: flag --schema needs an argument, such as --schema ratelimit; "},
		{[]string{"--lock-timeout", "soon", "up"}, `rl-migrate: flag --lock-timeout: "soon" is not a duration; use a number with a unit, such as --lock-timeout 5s (or 500ms, 30s, 5m, 24h); `},
		{[]string{"up", "--lock-wait=10"}, `rl-migrate: flag --lock-wait: "10" is not a duration; use a number with a unit, such as --lock-wait 1m`},
		{[]string{"layout", "partitioned", "--partition-width", "1x"}, `rl-migrate: flag --partition-width: "1x" is not a duration; use a number with a unit, such as --partition-width 1h`},
		{[]string{"layout", "partitioned", "--lookahead", "a day"}, `rl-migrate: flag --lookahead: "a day" is not a duration; use a number with a unit, such as --lookahead 24h`},
		{[]string{"--bogus", "up"}, "rl-migrate: unknown flag --bogus; "},
		{[]string{"status", "--bogus"}, "rl-migrate: unknown flag --bogus; "},
		{[]string{"down", "--all=maybe"}, `rl-migrate: flag --all: "maybe" is not true or false; write --all alone to turn it on; `},
	} {
		stdout, stderr, code := runFn(t, tc.args...)
		require.Equal(t, cli.ExitUsage, code, tc.args)
		require.Empty(t, stdout, tc.args)
		line := oneLine(t, stderr)
		require.True(t, strings.HasPrefix(line, tc.want), "%v:\n got %q\nwant %q...", tc.args, line, tc.want)
		require.NotContains(t, line, "parse error", tc.args)
		require.NotRegexp(t, `(^|\s)-[a-z]`, line, "single-dash flag name in %q", line)
		require.Equal(t, 1, strings.Count(line, "rl-migrate:"), line)
		require.True(t, strings.HasSuffix(line, "; run `rl-migrate --help` for usage"), line)
	}
}

// A role to grant to that does not exist is found before anything is done
// (the schema is not even created), with exit 2, and the hint repeats the
// command exactly as given, its password hidden.
func TestUpGrantToMissingRoleDoesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	s := dbtest.NewSchema(t) + "_new" // not created
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE")
	})
	existing := dbtest.NewRole(t)
	args := []string{"--database-url", dbtest.URL(), "--schema", s, "up", "--grant-to", existing + ",pgrl_no_such_role", "--grant-to", "pgrl_no_such_either", "--lock-wait", "30s"}
	stdout, stderr, code := runFn(t, args...)
	require.Equal(t, cli.ExitUsage, code, stderr)
	require.Empty(t, stdout)
	line := oneLine(t, stderr)
	require.Contains(t, line, `roles "pgrl_no_such_role", "pgrl_no_such_either" do not exist, so nothing was done`)
	require.Contains(t, line, `CREATE ROLE "pgrl_no_such_role" LOGIN PASSWORD '...'; CREATE ROLE "pgrl_no_such_either" LOGIN PASSWORD '...'`)
	require.Contains(t, line, "then run `rl-migrate --database-url '"+dbtest.URL()+"' --schema "+s+" up --grant-to "+existing+",pgrl_no_such_role --grant-to pgrl_no_such_either --lock-wait 30s` again")
	var exists bool
	require.NoError(t, admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", s).Scan(&exists))
	require.False(t, exists, "nothing was done: no schema was created")

	// In an existing schema: no table made, and the same with JSON output.
	s2 := dbtest.NewSchema(t)
	stdout, _, code = runFn(t, db(s2, "--output", "json", "up", "--grant-to", "pgrl_no_such_role")...)
	require.Equal(t, cli.ExitUsage, code)
	e := oneJSON(t, stdout)
	require.Contains(t, e["error"], `role "pgrl_no_such_role" does not exist, so nothing was done`)
	require.Contains(t, e["error"], "--schema "+s2+" --output json up --grant-to pgrl_no_such_role")
	require.Empty(t, relations(t, s2))

	// A password in the connection string is not repeated.
	url := strings.Replace(dbtest.URL(), "postgres://postgres@", "postgres://postgres:hunter2@", 1)
	require.NotEqual(t, dbtest.URL(), url, "the test URL has the expected form")
	_, stderr, code = runFn(t, "--database-url="+url, "--schema", s2, "up", "--grant-to", "pgrl_no_such_role")
	require.Equal(t, cli.ExitUsage, code, stderr)
	require.NotContains(t, stderr, "hunter2")
	require.Contains(t, stderr, "--database-url=postgres://postgres:xxxxx@")
}

// Each migration's log line carries the time that migration took, not the
// time since the run began: the times add up to no more than the run.
func TestMigrationLogTimesArePerMigration(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	start := time.Now()
	_, stderr, code := runFn(t, db(s, "up")...)
	elapsed := time.Since(start)
	require.Equal(t, cli.ExitOK, code, stderr)
	line := regexp.MustCompile(`(?m)^time=\S+ level=INFO msg="applied migration (\d{6}_\w+)" schema=\S+ took=(\S+)$`)
	matches := line.FindAllStringSubmatch(stderr, -1)
	require.Len(t, matches, len(migration.Available()), stderr)
	var sum time.Duration
	for i, m := range matches {
		require.Equal(t, migration.Available()[i].String(), m[1])
		d, err := time.ParseDuration(m[2])
		require.NoError(t, err, m[2])
		sum += d
	}
	require.LessOrEqual(t, sum, elapsed, "per-migration times add up to at most the run:\n%s", stderr)
	require.NotRegexp(t, `\d+/u \w+ \(`, stderr, "golang-migrate's cumulative times are not printed")

	_, stderr, code = runFn(t, db(s, "down")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Regexp(t, `msg="reverted migration `+regexp.QuoteMeta(migration.Latest().String())+`" schema=\S+ took=\S+`, stderr)
}
