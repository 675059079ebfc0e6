package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// sqlDecision is a row of pgrl_check.
type sqlDecision struct {
	Allowed                    bool
	Granted, Limit, Used, Left int64
	RetryAfter                 time.Duration
	RetryAfterSeconds          int64
	ResetAt                    time.Time
	ResetAfterSeconds          int64
}

// sqlCheck calls pgrl_check.
func sqlCheck(ctx context.Context, db *pgxpool.Pool, policyName, key string, cost int64) (sqlDecision, error) {
	var d sqlDecision
	err := db.QueryRow(ctx, `SELECT allowed, granted, "limit", used, remaining, retry_after, retry_after_seconds,
		       reset_at, reset_after_seconds FROM pgrl_check($1, $2, $3)`, policyName, key, cost).
		Scan(&d.Allowed, &d.Granted, &d.Limit, &d.Used, &d.Left, &d.RetryAfter, &d.RetryAfterSeconds, &d.ResetAt,
			&d.ResetAfterSeconds)
	return d, err
}

// newSQLCheckPolicy stores policy name and returns a Go limiter of it.
func newSQLCheckPolicy(t *testing.T, pool *pgxpool.Pool, p policy.Policy) *policy.Limiter {
	t.Helper()
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, p)
	require.NoError(t, err)
	lim, err := policy.NewLimiter(ctx, pool, p.Name, policy.Options{
		Config: ratelimit.Config{OnFailure: ratelimit.FailError, DenyCacheSize: -1},
	})
	require.NoError(t, err)
	return lim
}

// A SQL caller and a Go limiter of one policy share one counter: checks
// made alternately from both count together, both see the same figures,
// and a key's override applies to both.
func TestSQLCheckSharesTheGoCounter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	for _, alg := range ratelimit.Algorithms {
		for _, mode := range []ratelimit.KeyMode{ratelimit.HashedKeys, ratelimit.ReadableKeys} {
			name := fmt.Sprintf("sql-%s-%d", strings.ReplaceAll(string(alg), "_", "-"), mode)
			t.Run(name, func(t *testing.T) {
				lim := newSQLCheckPolicy(t, pool, policy.Policy{Name: name, Algorithm: alg, Limit: 10,
					Window: time.Hour, KeyMode: mode})
				// The Go side reads overrides from its cache: the one set
				// below is checked from SQL only.
				for i := range 5 {
					d, err := lim.Allow(ctx, "tenant-1", ratelimit.Cost(1))
					require.NoError(t, err)
					require.True(t, d.Allowed)
					s, err := sqlCheck(ctx, pool, name, "tenant-1", 1)
					require.NoError(t, err)
					require.True(t, s.Allowed)
					require.EqualValues(t, 1, s.Granted)
					require.EqualValues(t, 10, s.Limit)
					require.EqualValues(t, 2*i+2, s.Used, "check %d: the Go check and this one counted", i)
					require.EqualValues(t, 10-2*i-2, s.Left)
					require.Zero(t, s.RetryAfter)
				}
				s, err := sqlCheck(ctx, pool, name, "tenant-1", 1)
				require.NoError(t, err)
				require.False(t, s.Allowed)
				require.Zero(t, s.Granted)
				d, err := lim.Allow(ctx, "tenant-1")
				require.NoError(t, err)
				require.False(t, d.Allowed)
				// The same figures as the Go side's, a moment apart.
				require.Equal(t, d.Used, s.Used)
				require.Equal(t, d.Remaining, s.Left)
				require.Equal(t, d.Limit, s.Limit)
				require.InDelta(t, d.RetryAfter.Seconds(), s.RetryAfter.Seconds(), 2)
				require.InDelta(t, d.RetryAfterSeconds(), s.RetryAfterSeconds, 2)
				require.WithinDuration(t, d.ResetAt, s.ResetAt, 2*time.Second)
				require.InDelta(t, int64(d.ResetAfter().Seconds()), s.ResetAfterSeconds, 2)

				// An override of the key applies to both.
				_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: name,
					Key: policy.Policy{Name: name, KeyMode: mode}.StoredKey("vip"), Limit: 3})
				require.NoError(t, err)
				for i := range 4 {
					s, err := sqlCheck(ctx, pool, name, "vip", 1)
					require.NoError(t, err)
					require.Equal(t, i < 3, s.Allowed, "check %d of vip", i)
					require.EqualValues(t, 3, s.Limit)
				}
				_, err = sqlCheck(ctx, pool, name, "vip", 4)
				require.Error(t, err, "a cost above the override's limit")
			})
		}
	}
}

// Bad input raises with a stable SQLSTATE and a message that says what to
// fix, and counts nothing.
func TestSQLCheckErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	newSQLCheckPolicy(t, pool, policy.Policy{Name: "sql-errors", Algorithm: ratelimit.FixedWindow, Limit: 5,
		Window: 24 * time.Hour})
	newSQLCheckPolicy(t, pool, policy.Policy{Name: "sql-readable", Algorithm: ratelimit.FixedWindow, Limit: 5,
		Window: time.Minute, KeyMode: ratelimit.ReadableKeys})
	for _, c := range []struct {
		name, query, code, text string
	}{
		{"null policy", `SELECT * FROM pgrl_check(NULL, 'k')`, "22004", "must not be NULL"},
		{"null key", `SELECT * FROM pgrl_check('sql-errors', NULL)`, "22004", "must not be NULL"},
		{"null cost", `SELECT * FROM pgrl_check('sql-errors', 'k', NULL)`, "22004", "must not be NULL"},
		{"unknown policy", `SELECT * FROM pgrl_check('no-such', 'k')`, "42704", "no policy is named 'no-such'"},
		{"hostile name", `SELECT * FROM pgrl_check($$x'); DROP TABLE pgrl_policy; --$$, 'k')`, "42704", "no policy"},
		{"zero cost", `SELECT * FROM pgrl_check('sql-errors', 'k', 0)`, "22023", "ask for 1 to 5 units"},
		{"negative cost", `SELECT * FROM pgrl_check('sql-errors', 'k', -9223372036854775808)`, "22023", "ask for 1 to 5"},
		{"huge cost", `SELECT * FROM pgrl_check('sql-errors', 'k', 9223372036854775807)`, "22023", "ask for 1 to 5"},
		{"long readable key", `SELECT * FROM pgrl_check('sql-readable', repeat('x', 2049))`, "54000", "at most 2048"},
	} {
		_, err := pool.Exec(ctx, c.query)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%s: %v", c.name, err)
		require.Equal(t, c.code, pgErr.Code, c.name)
		require.Contains(t, pgErr.Message, c.text, c.name)
	}
	// Keys of any length and content are hashed; the empty key is a key.
	for _, key := range []string{"", strings.Repeat("é", 10000), "nul\x01byte", "'; --"} {
		s, err := sqlCheck(ctx, pool, "sql-errors", key, 1)
		require.NoError(t, err)
		require.EqualValues(t, 1, s.Used, "%q", key)
	}
	var n int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_policy").Scan(&n))
	require.Equal(t, 2, n, "the policies are still there")
	s, err := sqlCheck(ctx, pool, "sql-errors", "k", 1)
	require.NoError(t, err)
	require.EqualValues(t, 1, s.Used, "the refused checks counted nothing")
}

// Four OS processes in four languages check one key of one policy at
// once: a psql session, a Go process checking through package policy, a
// Python process (psycopg) and a Node process (pg), the last three as
// client programs of their own. 4 × 50 calls against a limit of 20:
// exactly 20 admitted, for every algorithm.
func TestSQLCheckMultiprocess(t *testing.T) {
	t.Parallel()
	python := sqlClient(t, "psql", "python3", "node")
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			name := "sql-mp-" + strings.ReplaceAll(string(alg), "_", "-")
			// A day's window: the run does not straddle a window's end
			// but once in thousands; the bucket refills 20 a day.
			newSQLCheckPolicy(t, pool, policy.Policy{Name: name, Algorithm: alg, Limit: 20, Window: 24 * time.Hour})
			const calls = 50
			// Every process first waits on an advisory lock this one
			// holds, released once all four wait: they check at once.
			gate, err := pool.Acquire(ctx)
			require.NoError(t, err)
			defer gate.Release()
			_, err = gate.Exec(ctx, "SELECT pg_advisory_lock($1)", sqlCheckGate)
			require.NoError(t, err)
			args := []string{dbtest.URL(), s, name, "shared", fmt.Sprint(calls), fmt.Sprint(sqlCheckGate)}
			script := fmt.Sprintf("\\o /dev/null\nSELECT pg_advisory_lock_shared(%d), pg_advisory_unlock_shared(%d);\n\\o\n",
				sqlCheckGate, sqlCheckGate) +
				strings.Repeat(fmt.Sprintf("SELECT allowed FROM pgrl_check('%s', 'shared');\n", name), calls)
			procs := map[string]*exec.Cmd{
				"psql":   exec.CommandContext(ctx, "psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", dbtest.URL()),
				"go":     exec.CommandContext(ctx, os.Args[0], "-test.run=^TestSQLCheckGoProcess$", "-test.count=1"),
				"python": exec.CommandContext(ctx, python, append([]string{"sqlclients/check.py"}, args...)...),
				"node":   exec.CommandContext(ctx, "node", append([]string{"sqlclients/check.js"}, args...)...),
			}
			procs["psql"].Env = append(os.Environ(), "PGOPTIONS=-c search_path="+s)
			procs["psql"].Stdin = strings.NewReader(script)
			procs["go"].Env = append(os.Environ(), sqlCheckChildEnv+"="+dbtest.URLWithSchema(s),
				"PGRL_SQL_CHECK_POLICY="+name)
			var mu sync.Mutex
			admitted := map[string]int{}
			var wg sync.WaitGroup
			for who, cmd := range procs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var stderr strings.Builder
					cmd.Stderr = &stderr
					out, err := cmd.Output()
					// The Go test binary prints its verdict after the answers.
					answers := strings.Fields(strings.TrimSuffix(strings.TrimSpace(string(out)), "PASS"))
					if err != nil || len(answers) != calls {
						t.Errorf("%s: %v: %d answers, want %d: %s %s", who, err, len(answers), calls, out, stderr.String())
						return
					}
					mu.Lock()
					defer mu.Unlock()
					for _, a := range answers {
						if a == "t" {
							admitted[who]++
						}
					}
				}()
			}
			require.Eventually(t, func() bool {
				var n int
				return pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
					AND objid = $1`, sqlCheckGate).Scan(&n) == nil && n == len(procs)
			}, time.Minute, 10*time.Millisecond, "every process waits at the gate")
			_, err = gate.Exec(ctx, "SELECT pg_advisory_unlock($1)", sqlCheckGate)
			require.NoError(t, err)
			wg.Wait()
			total := 0
			for _, n := range admitted {
				total += n
			}
			t.Logf("admitted per process: %v", admitted)
			require.Equal(t, 20, total, "exactly the limit, across the four languages")
		})
	}
}

// sqlClient fails the test unless psql, a Python with psycopg and a Node
// with pg (in sqlclients/node_modules) are here, naming the script that
// installs them; it returns the Python to run.
func sqlClient(t *testing.T, psql, python, node string) string {
	t.Helper()
	const fix = "run `bash scripts/sqlclients.sh` (as .ci/run does), which installs psycopg and pg"
	if _, err := exec.LookPath(psql); err != nil {
		t.Fatalf("psql is needed: %v; install PostgreSQL's client", err)
	}
	if out, err := exec.Command(node, "-e", "require('./sqlclients/node_modules/pg')").CombinedOutput(); err != nil {
		t.Fatalf("node with pg is needed: %v: %s; %s", err, out, fix)
	}
	// Debian's python3-psycopg installs for the system's Python.
	for _, p := range []string{python, "/usr/bin/python3"} {
		if exec.Command(p, "-c", "import psycopg").Run() == nil {
			return p
		}
	}
	t.Fatalf("a Python with psycopg is needed; %s", fix)
	return ""
}

// sqlCheckGate is the advisory lock the processes of
// TestSQLCheckMultiprocess start behind.
const sqlCheckGate = 7_702_001

// sqlCheckChildEnv carries the database URL to the Go processes of
// TestSQLCheckMultiprocess.
const sqlCheckChildEnv = "PGRL_SQL_CHECK_CHILD_URL"

// TestSQLCheckGoProcess is not a test of its own: run by
// TestSQLCheckMultiprocess as one of its processes, it checks the key
// "shared" of the policy PGRL_SQL_CHECK_POLICY 50 times through package
// policy and prints t or f for each.
func TestSQLCheckGoProcess(t *testing.T) {
	url := os.Getenv(sqlCheckChildEnv)
	if url == "" {
		t.Skip("a process of TestSQLCheckMultiprocess")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	lim, err := policy.NewLimiter(ctx, pool, os.Getenv("PGRL_SQL_CHECK_POLICY"), policy.Options{
		Config: ratelimit.Config{OnFailure: ratelimit.FailError, DenyCacheSize: -1},
	})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "SELECT pg_advisory_lock_shared($1), pg_advisory_unlock_shared($1)", int64(sqlCheckGate))
	require.NoError(t, err)
	var out strings.Builder
	for range 50 {
		d, err := lim.Allow(ctx, "shared")
		require.NoError(t, err)
		if d.Allowed {
			out.WriteString("t\n")
		} else {
			out.WriteString("f\n")
		}
	}
	fmt.Print(out.String())
}
