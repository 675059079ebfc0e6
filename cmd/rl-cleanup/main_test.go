package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// binary builds rl-cleanup once per test process.
func binary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "rl-cleanup-test")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "rl-cleanup")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, buildErr)
	return binPath
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" {
		_ = os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

func insertExpired(t *testing.T, db *pgxpool.Pool, n int) {
	t.Helper()
	_, err := db.Exec(context.Background(), `
		INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT sha256(int8send(g)), statement_timestamp() - interval '1 hour', 1, true
		  FROM generate_series(1, $1::bigint) AS g`, n)
	require.NoError(t, err)
}

func rows(t *testing.T, db *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	require.NoError(t, db.QueryRow(context.Background(), "SELECT count(*) FROM pgrl_fixed_window").Scan(&n))
	return n
}

func runCLI(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestBadInputExitsWithUsageAndDeletesNothing(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	insertExpired(t, db, 50)
	url := dbtest.URLWithSchema(schema)
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"--batch-size", "0"}, "--batch-size 0 is out of range"},
		{[]string{"--batch-size", "-5"}, "--batch-size -5 is out of range"},
		{[]string{"--max-duration", "0"}, "--max-duration 0s must be positive"},
		{[]string{"--max-duration", "-1m"}, "--max-duration -1m0s must be positive"},
		{[]string{"--horizon", "0"}, "--horizon 0s must be positive"},
		{[]string{"--horizon", "-2h"}, "--horizon -2h0m0s must be positive"},
		{[]string{"--lock-timeout", "0"}, "--lock-timeout 0s must be at least 1ms"},
		{[]string{"--statement-timeout", "-1s"}, "--statement-timeout -1s must be at least 1ms"},
		{[]string{"--mode", "truncate"}, `--mode "truncate" is not a mode`},
		{[]string{"--mode", "delete", "--partitions"}, "--partitions contradicts --mode delete"},
		{[]string{"--output", "xml"}, `--output "xml" is not a format`},
		{[]string{"now"}, `unexpected argument "now"`},
		{[]string{"--partitions"}, "pgrl_fixed_window is not partitioned; run `rl-migrate layout partitioned` first"},
		{[]string{"--mode", "partitions", "--dry-run"}, "pgrl_fixed_window is not partitioned"},
	} {
		args := append([]string{"--database-url", url}, tc.args...)
		code, stdout, stderr := runCLI(args...)
		require.Equal(t, cli.ExitUsage, code, "%v: %s", tc.args, stderr)
		require.Contains(t, stderr, tc.msg, "%v", tc.args)
		require.Empty(t, stdout, "%v", tc.args)
		require.Equal(t, 1, strings.Count(strings.TrimSpace(stderr), "\n")+1, "one line: %q", stderr)
	}
	code, _, stderr := runCLI("--no-such-flag")
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, stderr, "flag provided but not defined")
	require.Equal(t, int64(50), rows(t, db))
}

func TestHelpExitsZero(t *testing.T) {
	t.Parallel()
	code, _, stderr := runCLI("--help")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stderr, "Usage: rl-cleanup")
	require.Contains(t, stderr, "-max-duration")
}

func TestMissingTablesExitOneNamingMigrate(t *testing.T) {
	t.Parallel()
	schema := dbtest.NewSchema(t)
	code, stdout, stderr := runCLI("--database-url", dbtest.URL(), "--schema", schema)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, stderr, "rl-migrate up")
	require.Empty(t, stdout)
}

func TestUnreachableDatabaseExitsOne(t *testing.T) {
	t.Parallel()
	code, _, stderr := runCLI("--database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2")
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, stderr, "cannot reach the database")
}

func TestJSONOutputIsOneObject(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	insertExpired(t, db, 1234)

	code, stdout, stderr := runCLI("--database-url", dbtest.URL(), "--schema", schema, "--dry-run", "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var dry map[string]any
	dec := json.NewDecoder(strings.NewReader(stdout))
	require.NoError(t, dec.Decode(&dry))
	require.False(t, dec.More(), "exactly one JSON object")
	require.Equal(t, true, dry["dry_run"])
	require.Equal(t, float64(1234), dry["tables"].(map[string]any)["pgrl_fixed_window"].(map[string]any)["would_delete"])
	require.Equal(t, int64(1234), rows(t, db))

	code, stdout, stderr = runCLI("--database-url", dbtest.URL(), "--schema", schema, "--batch-size", "500", "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var res struct {
		Mode   string `json:"mode"`
		Tables map[string]struct {
			Deleted int64 `json:"deleted"`
			Batches int   `json:"batches"`
		} `json:"tables"`
		Batches       int    `json:"batches"`
		DurationMS    *int64 `json:"duration_ms"`
		StoppedEarly  bool   `json:"stopped_early"`
		Skipped       bool   `json:"skipped"`
		SkippedReason string `json:"skipped_reason"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &res))
	require.Equal(t, "delete", res.Mode)
	require.Equal(t, int64(1234), res.Tables["pgrl_fixed_window"].Deleted)
	require.Equal(t, 3, res.Tables["pgrl_fixed_window"].Batches)
	require.Contains(t, res.Tables, "pgrl_token_bucket")
	require.Contains(t, res.Tables, "pgrl_sliding_window")
	require.Contains(t, res.Tables, "pgrl_request")
	require.Contains(t, res.Tables, "pgrl_concurrency")
	require.Equal(t, 7, res.Batches)
	require.NotNil(t, res.DurationMS)
	require.False(t, res.StoppedEarly)
	require.False(t, res.Skipped)
	require.Zero(t, rows(t, db))
}

func TestTextOutput(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	insertExpired(t, db, 10)
	code, stdout, stderr := runCLI("--database-url", dbtest.URLWithSchema(schema))
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "pgrl_fixed_window: deleted 10 rows in 1 batches")
	require.Contains(t, stdout, "pgrl_concurrency: deleted 0 rows in 1 batches")
	require.Contains(t, stdout, "done in")
}

// insertSlots inserts n rows of pgrl_concurrency holding one slot each,
// keys prefix-1 to prefix-n, that lapses (and a row whose expires_at is)
// the database clock plus in.
func insertSlots(t *testing.T, db *pgxpool.Pool, prefix string, n int, in time.Duration) {
	t.Helper()
	_, err := db.Exec(context.Background(), `
		INSERT INTO pgrl_concurrency (key, slots, expires_at, updated_at)
		SELECT convert_to($1 || '-' || g, 'UTF8'),
		       ARRAY[ROW(sha256(convert_to($1 || g, 'UTF8')), pgrl_epoch_us(x.e))::pgrl_slot], x.e,
		       statement_timestamp() - interval '2 hours'
		  FROM generate_series(1, $2::integer) AS g,
		       LATERAL (SELECT statement_timestamp() + $3::bigint * interval '1 microsecond' AS e) AS x`,
		prefix, n, in.Microseconds())
	require.NoError(t, err)
}

// TestConcurrencyRowsCountedThenDeleted: the rows of concurrency limits
// whose every slot has lapsed are counted by --dry-run and deleted by a
// run, in JSON and in text; rows holding a live slot stay.
func TestConcurrencyRowsCountedThenDeleted(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	insertSlots(t, db, "lapsed", 1234, -time.Hour)
	insertSlots(t, db, "held", 5, time.Hour)
	count := func() int64 {
		var n int64
		require.NoError(t, db.QueryRow(context.Background(), "SELECT count(*) FROM pgrl_concurrency").Scan(&n))
		return n
	}

	code, stdout, stderr := runCLI("--database-url", dbtest.URLWithSchema(schema), "--dry-run", "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var res struct {
		Tables map[string]struct {
			Deleted     int64 `json:"deleted"`
			WouldDelete int64 `json:"would_delete"`
			Batches     int   `json:"batches"`
		} `json:"tables"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &res))
	require.Equal(t, int64(1234), res.Tables["pgrl_concurrency"].WouldDelete)
	require.Equal(t, int64(1239), count())

	code, stdout, stderr = runCLI("--database-url", dbtest.URLWithSchema(schema), "--dry-run")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "pgrl_concurrency: would delete 1234 rows\n")

	code, stdout, stderr = runCLI("--database-url", dbtest.URLWithSchema(schema), "--batch-size", "500", "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.NoError(t, json.Unmarshal([]byte(stdout), &res))
	require.Equal(t, int64(1234), res.Tables["pgrl_concurrency"].Deleted)
	require.Equal(t, 3, res.Tables["pgrl_concurrency"].Batches)
	require.Equal(t, int64(5), count())
}

// TestOlderSchemaWithoutConcurrency: a schema migrated up to 000018, before
// pgrl_concurrency, is cleaned as before and reports nothing of it.
func TestOlderSchemaWithoutConcurrency(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := dbtest.NewSchema(t)
	m, err := migration.New(dbtest.URL(), migration.Config{Schema: schema})
	require.NoError(t, err)
	_, err = m.UpTo(ctx, 18)
	require.NoError(t, m.Close())
	require.NoError(t, err)
	db := dbtest.PoolOn(t, schema)
	insertExpired(t, db, 12)

	code, stdout, stderr := runCLI("--database-url", dbtest.URLWithSchema(schema))
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "pgrl_fixed_window: deleted 12 rows in 1 batches")
	require.Contains(t, stdout, "pgrl_concurrency: deleted 0 rows in 0 batches")
	require.Empty(t, stderr)
	require.Zero(t, rows(t, db))
}

type procResult struct {
	code   int
	stdout string
	stderr string
}

func startProc(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	require.NoError(t, cmd.Start())
	return cmd, &out, &errb
}

func waitProc(cmd *exec.Cmd, out, errb *bytes.Buffer) procResult {
	err := cmd.Wait()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		code = -1
	}
	return procResult{code, out.String(), errb.String()}
}

func TestTwoProcessesOneWorksBothExitZero(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	const n = 200_000
	insertExpired(t, db, n)
	args := []string{"--database-url", dbtest.URLWithSchema(schema), "--batch-size", "100", "--output", "json"}

	// Start both together; the work (2,000 batches) lasts far longer than
	// the gap between the two starts.
	c1, o1, e1 := startProc(t, args...)
	c2, o2, e2 := startProc(t, args...)
	results := []procResult{waitProc(c1, o1, e1), waitProc(c2, o2, e2)}

	var worked, skipped int
	var deleted int64
	for _, r := range results {
		require.Equal(t, 0, r.code, r.stderr)
		var res struct {
			Skipped       bool   `json:"skipped"`
			SkippedReason string `json:"skipped_reason"`
			Tables        map[string]struct {
				Deleted int64 `json:"deleted"`
			} `json:"tables"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &res), r.stdout)
		if res.Skipped {
			skipped++
			require.Equal(t, "another rl-cleanup is running; nothing done", res.SkippedReason)
			require.Zero(t, res.Tables["pgrl_fixed_window"].Deleted)
		} else {
			worked++
			deleted += res.Tables["pgrl_fixed_window"].Deleted
		}
	}
	require.Equal(t, 1, worked)
	require.Equal(t, 1, skipped)
	require.Equal(t, int64(n), deleted)
	require.Zero(t, rows(t, db))

	// Text mode prints the sentence too.
	holder, err := db.Acquire(context.Background())
	require.NoError(t, err)
	defer holder.Release()
	var locked bool
	require.NoError(t, holder.QueryRow(context.Background(),
		"SELECT pg_try_advisory_lock(hashtext('pgrl_cleanup')::bigint << 32 | (SELECT relnamespace::oid::bigint FROM pg_class WHERE oid = 'pgrl_fixed_window'::regclass))").Scan(&locked))
	require.True(t, locked)
	code, stdout, stderr := runCLI("--database-url", dbtest.URLWithSchema(schema))
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, "another rl-cleanup is running; nothing done\n", stdout)
}

func TestSIGINTStopsBetweenBatchesWithSummary(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	const n = 20_000
	insertExpired(t, db, n)
	cmd := exec.Command(binary(t), "--database-url", dbtest.URLWithSchema(schema),
		"--batch-size", "100", "--batch-pause", "5ms", "--progress-every", "1ms", "--output", "json")
	var out bytes.Buffer
	cmd.Stdout = &out
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())

	// Wait for a progress line, then interrupt.
	sc := bufio.NewScanner(stderr)
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if strings.Contains(sc.Text(), "rows deleted in") {
			break
		}
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	r := waitProc(cmd, &out, &bytes.Buffer{})
	require.Equal(t, 0, r.code, strings.Join(lines, "\n"))
	require.Regexp(t, `rl-cleanup: pgrl_fixed_window: \d+ rows deleted in \d+ batches`, lines[0])

	var res struct {
		StoppedEarly bool   `json:"stopped_early"`
		StopReason   string `json:"stop_reason"`
		Tables       map[string]struct {
			Deleted int64 `json:"deleted"`
		} `json:"tables"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res), r.stdout)
	require.True(t, res.StoppedEarly)
	require.Equal(t, "cancelled", res.StopReason)
	deleted := res.Tables["pgrl_fixed_window"].Deleted
	require.Greater(t, deleted, int64(0))
	require.Less(t, deleted, int64(n))
	require.Equal(t, int64(n)-deleted, rows(t, db), "the summary matches the table")
}

// A run skipped because another cleanup holds the lock computed no cutoff:
// its JSON result has no "cutoff" member (not the zero time).
func TestSkippedRunReportsNoCutoff(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	holder, err := db.Acquire(context.Background())
	require.NoError(t, err)
	defer holder.Release()
	var locked bool
	require.NoError(t, holder.QueryRow(context.Background(),
		"SELECT pg_try_advisory_lock(hashtext('pgrl_cleanup')::bigint << 32 | (SELECT relnamespace::oid::bigint FROM pg_class WHERE oid = 'pgrl_fixed_window'::regclass))").Scan(&locked))
	require.True(t, locked)

	code, stdout, stderr := runCLI("--database-url", dbtest.URLWithSchema(schema), "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.Equal(t, true, res["skipped"], stdout)
	require.NotContains(t, res, "cutoff", "a skipped run computed no cutoff: %s", stdout)
	require.NotContains(t, stdout, "0001-01-01")

	// A run that works reports its cutoff.
	_, err = holder.Exec(context.Background(), "SELECT pg_advisory_unlock_all()")
	require.NoError(t, err)
	code, stdout, stderr = runCLI("--database-url", dbtest.URLWithSchema(schema), "--output", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	res = nil
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.Equal(t, false, res["skipped"], stdout)
	require.IsType(t, "", res["cutoff"], stdout)
}
