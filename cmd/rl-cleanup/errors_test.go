package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
)

// hostileFlags lists, for every flag that takes a value, values a hostile or
// careless user might pass: empty, negative, zero, huge, max-int, malformed.
var hostileFlags = map[string][]string{
	"--batch-size":        {"", "abc", "-1", "0", "1000001", "9223372036854775807", "99999999999999999999", "1.5"},
	"--max-duration":      {"", "abc", "-1s", "0", "1e9h", "9223372036854775807ns", "200h", "5"},
	"--horizon":           {"", "abc", "-1h", "0", "1e9h", "9000h", "5"},
	"--lock-timeout":      {"", "abc", "-1s", "0", "500us", "600h", "2562047h", "5"},
	"--statement-timeout": {"", "abc", "-1s", "0", "500us", "600h", "5"},
	"--batch-pause":       {"", "abc", "-1ms", "2h", "5"},
	"--max-grace":         {"", "abc", "-1m", "0", "5"},
	"--progress-every":    {"", "abc", "-1s", "0"},
	"--mode":              {"", "truncate", "DELETE"},
	"--output":            {"", "xml", "JSON"},
	"--schema":            {"", " "},
	"--database-url":      {""},
	"--dry-run":           {"maybe"},
}

// TestHostileFlagValuesAreOneLineUsageErrors: every bad value exits 2 with
// one line on stderr that names the fix, and nothing on stdout; with
// --output json, one JSON object on stdout and nothing on stderr.
func TestHostileFlagValuesAreOneLineUsageErrors(t *testing.T) {
	t.Parallel()
	for name, values := range hostileFlags {
		for _, v := range values {
			arg := name + "=" + v
			code, stdout, stderr := runCLI(arg)
			require.Equal(t, cli.ExitUsage, code, "%s: %s", arg, stderr)
			require.Empty(t, stdout, arg)
			line := strings.TrimSuffix(stderr, "\n")
			require.NotEmpty(t, line, arg)
			require.NotContains(t, line, "\n", "%s: one line: %q", arg, stderr)
			require.True(t, strings.HasPrefix(line, "rl-cleanup: "), line)
			require.Regexp(t, `use |pass |name |omit |run `, line, "%s: the line names the fix", arg)

			if name == "--output" {
				continue
			}
			code, stdout, stderr = runCLI("--output", "json", arg)
			require.Equal(t, cli.ExitUsage, code, arg)
			require.Empty(t, stderr, arg)
			requireOneErrorObject(t, stdout, cli.ExitUsage)
		}
	}
	for _, args := range [][]string{{"--no-such-flag"}, {"-x"}, {"now"}, {"--batch-size"}} {
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, cli.ExitUsage, code, "%v", args)
		require.Empty(t, stdout)
		require.Equal(t, 1, strings.Count(stderr, "\n"), "%v: one line: %q", args, stderr)
		require.Contains(t, stderr, "rl-cleanup --help")

		code, stdout, stderr = runCLI(append(args, "--output=json")...)
		require.Equal(t, cli.ExitUsage, code, "%v", args)
		if args[0] != "--batch-size" { // there --output=json is the missing value
			require.Empty(t, stderr)
			requireOneErrorObject(t, stdout, cli.ExitUsage)
		}
	}
}

func requireOneErrorObject(t *testing.T, stdout string, code int) map[string]any {
	t.Helper()
	require.Equal(t, 1, strings.Count(stdout, "\n"), "one JSON object: %q", stdout)
	var obj map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &obj), stdout)
	require.NotEmpty(t, obj["error"], stdout)
	require.Equal(t, float64(code), obj["exit_code"], stdout)
	return obj
}

// TestRuntimeErrorsAreOneJSONObject: connection errors, missing tables and a
// signal before any work give one JSON object with --output json.
func TestRuntimeErrorsAreOneJSONObject(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI("--output", "json", "--database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2")
	require.Equal(t, cli.ExitError, code)
	require.Empty(t, stderr)
	require.Contains(t, requireOneErrorObject(t, stdout, cli.ExitError)["error"], "cannot reach the database")

	code, stdout, _ = runCLI("--output", "json", "--database-url", "::not a url")
	require.Equal(t, cli.ExitUsage, code)
	requireOneErrorObject(t, stdout, cli.ExitUsage)

	schema := dbtest.NewSchema(t)
	code, stdout, stderr = runCLI("--output", "json", "--database-url", dbtest.URL(), "--schema", schema)
	require.Equal(t, cli.ExitError, code)
	require.Empty(t, stderr)
	require.Contains(t, requireOneErrorObject(t, stdout, cli.ExitError)["error"], "rl-migrate up")

	_, migrated := dbtest.Pool(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out, errb strings.Builder
	code = run(ctx, []string{"--output", "json", "--database-url", dbtest.URLWithSchema(migrated)}, &out, &errb)
	require.NotEqual(t, cli.ExitOK, code)
	requireOneErrorObject(t, out.String(), code)
}

// TestMissingGrantIsNamed: a role that cannot use the schema, or cannot
// delete from the tables, is told which grant is missing, not that the
// tables are missing.
func TestMissingGrantIsNamed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := dbtest.Pool(t)
	admin := dbtest.Admin(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	role := "pgrl_cleanup_" + hex.EncodeToString(b)
	_, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+role)
	})
	u, err := url.Parse(dbtest.URL())
	require.NoError(t, err)
	u.User = url.User(role)
	asRole := u.String()

	// No USAGE on the schema: the tables are hidden from the role.
	code, stdout, stderr := runCLI("--database-url", asRole, "--schema", schema)
	require.Equal(t, cli.ExitError, code, stderr)
	require.Empty(t, stdout)
	require.Contains(t, stderr, "lacks USAGE on schema "+schema)
	require.Contains(t, stderr, "GRANT USAGE ON SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize())
	require.NotContains(t, stderr, "rl-migrate up")

	// USAGE but no DELETE.
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+role)
	require.NoError(t, err)
	code, stdout, _ = runCLI("--database-url", asRole, "--schema", schema, "--output", "json")
	require.Equal(t, cli.ExitError, code)
	msg := requireOneErrorObject(t, stdout, cli.ExitError)["error"].(string)
	require.Contains(t, msg, "lacks SELECT or DELETE on pgrl_fixed_window")
	require.Contains(t, msg, "GRANT SELECT, DELETE ON")

	// With the grants, delete mode works; partition mode needs the owner.
	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON ALL TABLES IN SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+role)
	require.NoError(t, err)
	code, _, stderr = runCLI("--database-url", asRole, "--schema", schema)
	require.Equal(t, cli.ExitOK, code, stderr)
	tx, err := admin.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT pgrl_fixed_window_set_layout('partitioned', interval '1 hour')")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	// The switch recreated pgrl_fixed_window: grant again.
	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON ALL TABLES IN SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+role)
	require.NoError(t, err)
	code, _, stderr = runCLI("--database-url", asRole, "--schema", schema, "--partitions")
	require.Equal(t, cli.ExitError, code, stderr)
	require.Contains(t, stderr, "only its owner")
}

// TestHiddenTransactionsHoldTheCutoffBack: a role without
// pg_read_all_stats cannot see when another role's transaction began, so an
// open one holds the cutoff back by the whole grace.
func TestHiddenTransactionsHoldTheCutoffBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, schema := dbtest.Pool(t)
	admin := dbtest.Admin(t)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	role := "pgrl_cleanup_" + hex.EncodeToString(b)
	_, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+role)
	})
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+role)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON ALL TABLES IN SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+role)
	require.NoError(t, err)
	u, err := url.Parse(dbtest.URL())
	require.NoError(t, err)
	u.User = url.User(role)

	// A superuser's open transaction is hidden from the role.
	tx, err := admin.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT 1")
	require.NoError(t, err)

	code, stdout, stderr := runCLI("--database-url", u.String(), "--schema", schema, "--output", "json", "--max-grace", "1h")
	require.Equal(t, cli.ExitOK, code, stderr)
	var res struct {
		Cutoff       time.Time `json:"cutoff"`
		CutoffHeldBy string    `json:"cutoff_held_by"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.Contains(t, res.CutoffHeldBy, "other roles")
	require.Contains(t, res.CutoffHeldBy, "pg_read_all_stats")
	require.WithinDuration(t, time.Now().Add(-time.Hour), res.Cutoff, time.Minute)
	// --horizon (partitions made ahead) is another thing: the result has no
	// key of that name.
	require.NotContains(t, stdout, `"horizon`)
}

// Missing tables: the error names the schema, the database and the user
// rl-cleanup looked with, and the fix for that schema.
func TestNotMigratedNamesWhereItLooked(t *testing.T) {
	t.Parallel()
	schema := dbtest.NewSchema(t)
	var database, user string
	require.NoError(t, dbtest.Admin(t).QueryRow(context.Background(), "SELECT current_database(), current_user").Scan(&database, &user))
	code, _, stderr := runCLI("--database-url", dbtest.URL(), "--schema", schema)
	require.Equal(t, cli.ExitError, code, stderr)
	require.Contains(t, stderr, fmt.Sprintf("rl-cleanup: pgrl's tables are missing in schema %q of database %q (user %q)", schema, database, user))
	require.Contains(t, stderr, "rl-migrate up --schema "+schema)
	require.NotContains(t, stderr, "no database URL")
}

// Run as cron runs it, with no environment but PATH and HOME, rl-cleanup
// connects with libpq's defaults. Whatever that reaches (here, or nothing),
// the error says that no database URL is configured, and a "tables are
// missing" error shows the database and the user it tried.
func TestNoURLConfiguredSaysSo(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{nil, {"--output", "json"}} {
		cmd := exec.Command(binary(t), args...)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "stdout %s stderr %s", out.String(), errb.String())
		require.Equal(t, cli.ExitError, ee.ExitCode())
		msg := errb.String()
		if len(args) > 0 {
			var res struct {
				Error    string `json:"error"`
				ExitCode int    `json:"exit_code"`
			}
			require.NoError(t, json.Unmarshal(out.Bytes(), &res), out.String())
			require.Equal(t, cli.ExitError, res.ExitCode)
			msg = res.Error
		}
		require.Contains(t, msg, "no database URL is configured", msg)
		require.Contains(t, msg, "set DATABASE_URL")
		if strings.Contains(msg, "tables are missing") {
			require.Regexp(t, `of database "[^"]*" \(user "[^"]*"\)`, msg)
		}
	}
}
