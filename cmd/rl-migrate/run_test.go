package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
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

// binary is rl-migrate built once for the tests that run it as a process.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rl-migrate-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "rl-migrate")
	out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		_ = os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// runFn calls run directly and returns stdout, stderr and the exit code.
func runFn(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := run(ctx, args, &stdout, &stderr)
	return stdout.String(), stderr.String(), code
}

// binCmd prepares the built binary with a clean environment.
func binCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(binary, args...)
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}
	cmd.Env = env
	return cmd
}

func runBin(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := binCmd(args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		require.True(t, ok, "run %v: %v", args, err)
		code = ee.ExitCode()
	}
	return stdout.String(), stderr.String(), code
}

// db returns the flags that point rl-migrate at the test database and schema.
func db(schemaName string, more ...string) []string {
	return append([]string{"--database-url", dbtest.URL(), "--schema", schemaName}, more...)
}

// oneJSON decodes stdout, which must hold exactly one JSON object.
func oneJSON(t *testing.T, stdout string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(stdout))
	var v map[string]any
	require.NoError(t, dec.Decode(&v), "stdout: %q", stdout)
	var extra any
	require.ErrorIs(t, dec.Decode(&extra), io.EOF, "more than one JSON value on stdout: %q", stdout)
	return v
}

func oneLine(t *testing.T, s string) string {
	t.Helper()
	s = strings.TrimRight(s, "\n")
	require.NotEmpty(t, s)
	require.NotContains(t, s, "\n", "expected one line, got %q", s)
	return s
}

// relations returns name -> (persistence, fillfactor) for the schema's
// tables that store rows, partitions included.
func relations(t *testing.T, schemaName string) map[string][2]string {
	t.Helper()
	rows, err := dbtest.Admin(t).Query(context.Background(), `
		SELECT c.relname, c.relpersistence::text,
		       coalesce((SELECT o FROM unnest(c.reloptions) o WHERE o LIKE 'fillfactor=%'), '')
		  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = $1 AND c.relkind = 'r'`, schemaName)
	require.NoError(t, err)
	out := map[string][2]string{}
	for rows.Next() {
		var name, p, ff string
		require.NoError(t, rows.Scan(&name, &p, &ff))
		out[name] = [2]string{p, ff}
	}
	require.NoError(t, rows.Err())
	return out
}

func requireUnloggedLowFillfactor(t *testing.T, schemaName string, wantPartitions bool) {
	t.Helper()
	rels := relations(t, schemaName)
	partitions := 0
	for name, r := range rels {
		if name == migration.DefaultTable || name == "pgrl_partition_settings" || name == "schema_migrations" ||
			name == "pgrl_policy" || name == "pgrl_policy_override" { // configuration: logged
			continue
		}
		require.Equal(t, "u", r[0], "%s must be UNLOGGED", name)
		if name == "pgrl_request" {
			// Written once per request, never updated: no room to keep
			// for HOT updates.
			continue
		}
		require.True(t, strings.HasPrefix(r[1], "fillfactor="), "%s has no fillfactor", name)
		ff, err := strconv.Atoi(strings.TrimPrefix(r[1], "fillfactor="))
		require.NoError(t, err)
		require.LessOrEqual(t, ff, 70, name)
		if strings.HasPrefix(name, "pgrl_fixed_window_") {
			partitions++
		}
	}
	for _, name := range []string{"pgrl_token_bucket", "pgrl_sliding_window"} {
		require.Contains(t, rels, name)
	}
	if wantPartitions {
		require.Greater(t, partitions, 0)
		require.NotContains(t, rels, "pgrl_fixed_window", "parent is partitioned")
	} else {
		require.Contains(t, rels, "pgrl_fixed_window")
		require.Zero(t, partitions)
	}
}

func TestUpStatusLayoutDown(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)

	stdout, _, code := runFn(t, db(s, "--output", "json", "status", "--check")...)
	require.Equal(t, cli.ExitPending, code)
	st := oneJSON(t, stdout)
	require.Len(t, st["pending"], len(migration.Available()))

	stdout, _, code = runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "migrated from version 0 to "+strconv.Itoa(int(migration.Latest().Version)))
	requireUnloggedLowFillfactor(t, s, false)

	stdout, _, code = runFn(t, db(s, "status", "--output", "json", "--check")...)
	require.Equal(t, cli.ExitOK, code)
	st = oneJSON(t, stdout)
	require.Equal(t, []any{}, st["pending"])
	require.Equal(t, float64(migration.Latest().Version), st["version"])
	require.Equal(t, false, st["dirty"])
	require.Equal(t, "plain", st["layout"])
	require.Equal(t, migration.DefaultTable, st["migrations_table"])

	stdout, _, code = runFn(t, db(s, "--output", "json", "up")...)
	require.Equal(t, cli.ExitOK, code)
	require.Equal(t, false, oneJSON(t, stdout)["changed"])

	stdout, _, code = runFn(t, db(s, "layout", "partitioned", "--partition-width", "30m", "--output", "json")...)
	require.Equal(t, cli.ExitOK, code, stdout)
	lay := oneJSON(t, stdout)
	require.Equal(t, "partitioned", lay["layout"])
	require.Equal(t, float64(1800), lay["partition_width_seconds"])
	requireUnloggedLowFillfactor(t, s, true)

	stdout, _, code = runFn(t, db(s, "status")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "partitioned (partitions of 30m0s)")

	_, _, code = runFn(t, db(s, "layout", "plain")...)
	require.Equal(t, cli.ExitOK, code)
	requireUnloggedLowFillfactor(t, s, false)

	stdout, _, code = runFn(t, db(s, "down")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "reverted "+migration.Latest().String())

	stdout, _, code = runFn(t, db(s, "--output", "json", "down", "--all")...)
	require.Equal(t, cli.ExitOK, code)
	require.Equal(t, float64(0), oneJSON(t, stdout)["to"])
	require.Equal(t, map[string][2]string{migration.DefaultTable: {"p", ""}}, relations(t, s))

	// up -> down -> up round-trips.
	_, _, code = runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code)
	requireUnloggedLowFillfactor(t, s, false)
	_, _, code = runFn(t, db(s, "status", "--check")...)
	require.Equal(t, cli.ExitOK, code)
}

func TestLayoutKeepsLiveRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	_, _, code := runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code)
	pool := dbtest.PoolOn(t, s)
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT int4send(i), now() + i * interval '7 minutes', i, i % 2 = 0 FROM generate_series(1, 40) i`)
	require.NoError(t, err)
	snapshot := func() string {
		var s string
		require.NoError(t, pool.QueryRow(ctx, `SELECT string_agg(encode(key, 'hex') || ':' || count || ':' || allowed || ':' || expires_at, ',' ORDER BY key)
			FROM pgrl_fixed_window`).Scan(&s))
		return s
	}
	before := snapshot()
	_, _, code = runFn(t, db(s, "layout", "partitioned", "--partition-width", "1h")...)
	require.Equal(t, cli.ExitOK, code)
	require.Equal(t, before, snapshot())
	_, _, code = runFn(t, db(s, "layout", "plain")...)
	require.Equal(t, cli.ExitOK, code)
	require.Equal(t, before, snapshot())
}

// Two rl-migrate processes started at the same moment both succeed and the
// migrations are applied once.
func TestConcurrentProcesses(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	const n = 2
	cmds := make([]*exec.Cmd, n)
	outs := make([]*bytes.Buffer, n)
	errs := make([]*bytes.Buffer, n)
	for i := range cmds {
		cmds[i] = binCmd(db(s, "--output", "json", "up")...)
		outs[i], errs[i] = &bytes.Buffer{}, &bytes.Buffer{}
		cmds[i].Stdout, cmds[i].Stderr = outs[i], errs[i]
	}
	for _, c := range cmds {
		require.NoError(t, c.Start())
	}
	changed := 0
	for i, c := range cmds {
		require.NoError(t, c.Wait(), "process %d: %s", i, errs[i])
		if oneJSON(t, outs[i].String())["changed"] == true {
			changed++
		}
	}
	require.Equal(t, 1, changed, "exactly one process applies the migrations")
	stdout, _, code := runBin(t, db(s, "--output", "json", "status", "--check")...)
	require.Equal(t, cli.ExitOK, code, stdout)
	requireUnloggedLowFillfactor(t, s, false)
}

func TestAppSchemaMigrationsUntouched(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	admin := dbtest.Admin(t)
	app := pgx.Identifier{s, "schema_migrations"}.Sanitize()
	_, err := admin.Exec(ctx, "CREATE TABLE "+app+" (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)")
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "INSERT INTO "+app+" VALUES (42, false)")
	require.NoError(t, err)

	_, stderr, code := runBin(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = runBin(t, db(s, "down", "--all")...)
	require.Equal(t, cli.ExitOK, code, stderr)

	var got string
	require.NoError(t, admin.QueryRow(ctx, "SELECT string_agg(version || ':' || dirty, ',') FROM "+app).Scan(&got))
	require.Equal(t, "42:false", got)

	// Pointing rl-migrate at the app's table is a usage error.
	_, stderr, code = runBin(t, db(s, "--migrations-table", "schema_migrations", "up")...)
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, oneLine(t, stderr), "golang-migrate's default table")
}

func TestDirtyExitsThreeAndNamesForce(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	_, _, code := runFn(t, db(s, "up", "1")...)
	require.Equal(t, cli.ExitOK, code)
	_, err := dbtest.Admin(t).Exec(context.Background(), "UPDATE "+pgx.Identifier{s, migration.DefaultTable}.Sanitize()+" SET dirty = true")
	require.NoError(t, err)

	_, stderr, code := runBin(t, db(s, "up")...)
	require.Equal(t, cli.ExitDirty, code)
	line := oneLine(t, stderr)
	require.Contains(t, line, "rl-migrate force 1")

	stdout, _, code := runFn(t, db(s, "--output", "json", "down")...)
	require.Equal(t, cli.ExitDirty, code)
	e := oneJSON(t, stdout)
	require.Contains(t, e["error"], "rl-migrate force")
	require.Equal(t, float64(cli.ExitDirty), e["exit_code"])

	_, _, code = runFn(t, db(s, "status", "--check")...)
	require.Equal(t, cli.ExitDirty, code)

	stdout, _, code = runFn(t, db(s, "force", "1")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "recorded version 1")
	_, _, code = runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code)
	_, _, code = runFn(t, db(s, "status", "--check")...)
	require.Equal(t, cli.ExitOK, code)
}

func TestUnknownVersion(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	for _, args := range [][]string{{"up", "999"}, {"force", "999"}, {"sql", "999"}} {
		_, stderr, code := runFn(t, db(s, args...)...)
		require.Equal(t, cli.ExitUsage, code, args)
		line := oneLine(t, stderr)
		require.Contains(t, line, "no pgrl migration has version 999")
		require.Contains(t, line, "available versions: 1 (counters), 2 (partitioning)")
	}
	// Nothing was done.
	require.Empty(t, relations(t, s))

	// A database migrated by a newer build.
	_, _, code := runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitOK, code)
	_, err := dbtest.Admin(t).Exec(context.Background(), "UPDATE "+pgx.Identifier{s, migration.DefaultTable}.Sanitize()+" SET version = 999")
	require.NoError(t, err)
	_, stderr, code := runFn(t, db(s, "up")...)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, oneLine(t, stderr), "use a newer rl-migrate")
}

func TestUnreachableDatabase(t *testing.T) {
	t.Parallel()
	url := "postgres://postgres:secret@127.0.0.1:1/pgrl_test?sslmode=disable&connect_timeout=5"
	_, stderr, code := runBin(t, "--database-url", url, "up")
	require.Equal(t, cli.ExitError, code)
	line := oneLine(t, stderr)
	require.Contains(t, line, "cannot reach the database")
	require.Contains(t, line, "check that PostgreSQL is running")
	require.NotContains(t, line, "secret")

	// From the environment, with JSON output.
	cmd := binCmd("--output", "json", "status")
	cmd.Env = append(cmd.Env, "DATABASE_URL="+url)
	out, err := cmd.Output()
	require.Error(t, err)
	require.Equal(t, cli.ExitError, cmd.ProcessState.ExitCode())
	require.Contains(t, oneJSON(t, string(out))["error"], "cannot reach the database")
}

func TestWrongPassword(t *testing.T) {
	t.Parallel()
	url := scramCluster(t)
	_, stderr, code := runBin(t, "--database-url", url, "up")
	require.Equal(t, cli.ExitError, code)
	line := oneLine(t, stderr)
	require.Contains(t, line, "authentication failed")
	require.Contains(t, line, "check the user and password")
	require.NotContains(t, line, "wrongpw")
}

func TestSQLNeedsNoDatabase(t *testing.T) {
	t.Parallel()
	cmd := binCmd("sql", "1", "up")
	cmd.Env = append(cmd.Env, "DATABASE_URL=postgres://nobody@127.0.0.1:1/none", "PGHOST=203.0.113.1")
	out, err := cmd.Output()
	require.NoError(t, err)
	want, err := migration.SQL(1, migration.Up)
	require.NoError(t, err)
	require.Equal(t, want, string(out))

	stdout, _, code := runFn(t, "--output", "json", "sql", "2", "down")
	require.Equal(t, cli.ExitOK, code)
	v := oneJSON(t, stdout)
	require.Equal(t, "partitioning", v["name"])
	require.Contains(t, v["sql"], "pgrl_fixed_window_set_layout('plain')")

	stdout, _, code = runFn(t, "version")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, migration.Latest().String())
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"bogus"},
		{"--bogus", "up"},
		{"up", "x"},
		{"up", "1", "2"},
		{"down", "3"},
		{"force"},
		{"force", "-1"},
		{"sql"},
		{"sql", "1", "sideways"},
		{"layout"},
		{"layout", "sideways"},
		{"layout", "partitioned", "--partition-width", "10ms"},
		{"status", "extra"},
		{"--output", "yaml", "status"},
		{"--lock-timeout", "0s", "up"},
		{"--lock-timeout", "soon", "up"},
	} {
		stdout, stderr, code := runFn(t, args...)
		require.Equal(t, cli.ExitUsage, code, "%v", args)
		require.Empty(t, stdout, "%v", args)
		require.Contains(t, oneLine(t, stderr), "rl-migrate --help", "%v", args)

		stdout, _, code = runFn(t, append([]string{"--output", "json"}, args...)...)
		require.Equal(t, cli.ExitUsage, code, "%v", args)
		if len(args) == 0 || args[0] != "--output" {
			require.NotEmpty(t, oneJSON(t, stdout)["error"], "%v", args)
		}
	}

	stdout, _, code := runFn(t, "--help")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "Examples:")
	require.Contains(t, stdout, "rl-migrate up")
	stdout, _, code = runFn(t, "up", "--help")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "Exit codes")
	_, _, code = runBin(t, "-h")
	require.Equal(t, cli.ExitOK, code)
}

func TestInterrupted(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, db(s, "up"), &stdout, &stderr)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, oneLine(t, stderr.String()), "interrupted")
	require.Empty(t, relations(t, s))
}

// scramCluster starts a throwaway PostgreSQL that requires a password and
// returns a URL with the wrong one.
func scramCluster(t *testing.T) string {
	t.Helper()
	c := startCluster(t, "scram-sha-256", "rightpw")
	return fmt.Sprintf("postgres://postgres:wrongpw@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}
