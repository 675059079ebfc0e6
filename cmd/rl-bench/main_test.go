package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/loadtest"
)

func runBench(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	code := run(ctx, args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestBenchJSONReport(t *testing.T) {
	// An empty schema: rl-bench creates its tables itself.
	schema := dbtest.NewSchema(t)
	const keys = 50
	code, stdout, stderr := runBench(t,
		"--database-url", dbtest.URL(), "--schema", schema,
		"--duration", "200ms", "--warmup", "50ms",
		"--callers", "1,2", "--keys", "50,1", "--output", "json")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}

	// The field names a user's scripts read.
	var raw map[string]any
	if err := json.Unmarshal([]byte(stdout), &raw); err != nil {
		t.Fatalf("output is not one JSON object: %v\n%s", err, stdout)
	}
	cases, _ := raw["cases"].([]any)
	if len(cases) != 12 {
		t.Fatalf("%d cases, want 3 algorithms × 2 caller counts × 2 key spreads = 12", len(cases))
	}
	first, _ := cases[0].(map[string]any)
	for _, f := range []string{"algorithm", "callers", "keys", "library_ops_per_sec", "raw_ops_per_sec", "throughput_ratio",
		"library_p50_us", "raw_p50_us", "p50_ratio", "library_p99_us", "raw_p99_us"} {
		if _, ok := first[f]; !ok {
			t.Errorf("case lacks %q: %v", f, first)
		}
	}
	if _, ok := first["statement_checks"]; ok {
		t.Errorf("a plain run reports a statement path: %v", first)
	}
	if _, ok := raw["hot_update_ratio"].(map[string]any); !ok {
		t.Errorf("no hot_update_ratio object: %v", raw["hot_update_ratio"])
	}

	var rep Report
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Machine.ServerVersion == "" || rep.Machine.NumCPU < 1 || rep.Machine.GOOS == "" {
		t.Errorf("machine info incomplete: %+v", rep.Machine)
	}
	seen := map[string]bool{}
	for _, c := range rep.Cases {
		seen[c.Algorithm] = true
		if c.RawChecks == 0 || c.LibraryChecks == 0 || c.RawOpsPerSec <= 0 || c.LibraryOpsPerSec <= 0 {
			t.Errorf("%+v: a path ran no checks", c)
		}
		if c.RawP50Us <= 0 || c.RawP50Us > c.RawP99Us || c.LibraryP50Us <= 0 || c.LibraryP50Us > c.LibraryP99Us {
			t.Errorf("%+v: percentiles out of order", c)
		}
		if !isRatioOf(c.ThroughputRatio, c.LibraryOpsPerSec, c.RawOpsPerSec) {
			t.Errorf("%+v: throughput ratio is not library/raw", c)
		}
		if !isRatioOf(c.P50Ratio, c.LibraryP50Us, c.RawP50Us) {
			t.Errorf("%+v: p50 ratio is not library/raw", c)
		}
	}
	if len(seen) != 3 {
		t.Errorf("algorithms measured: %v", seen)
	}
	for _, table := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
		v, ok := rep.HotUpdateRatio[table]
		if !ok || v <= 0 || v > 1 {
			t.Errorf("hot_update_ratio[%s] = %v (present %v), want a fraction", table, v, ok)
		}
		if u := rep.TableUpdates[table]; u.Updates == 0 || u.HotUpdates > u.Updates {
			t.Errorf("table_updates[%s] = %+v", table, u)
		}
	}

	// The raw path must hit the very rows the library does: had it sent
	// other key bytes, each table would hold the keys twice.
	pool := dbtest.PoolOn(t, schema)
	for _, table := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
		var n int
		if err := pool.QueryRow(context.Background(), "SELECT count(DISTINCT key) FROM "+pgx.Identifier{table}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != keys {
			t.Errorf("%s holds %d distinct keys, want %d: raw and library paths wrote different rows", table, n, keys)
		}
	}
}

// TestBenchStatementPath runs the third path of --policy and
// --request-ids: the feature's statement sent directly, on the library's
// own rows, with ratios that split the library's.
func TestBenchStatementPath(t *testing.T) {
	for _, flags := range [][]string{{"--policy"}, {"--policy", "--policy-overrides", "0"}, {"--request-ids"}} {
		flag := flags[0]
		t.Run(strings.Join(flags, " "), func(t *testing.T) {
			schema := dbtest.NewSchema(t)
			const keys = 20
			code, stdout, stderr := runBench(t, append(flags,
				"--database-url", dbtest.URL(), "--schema", schema,
				"--duration", "200ms", "--warmup", "0s", "--callers", "1", "--keys", "20", "--output", "json")...)
			if code != 0 {
				t.Fatalf("exit %d; stderr:\n%s", code, stderr)
			}
			var rep Report
			if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
				t.Fatal(err)
			}
			if len(rep.Cases) != 3 {
				t.Fatalf("%d cases, want one per algorithm", len(rep.Cases))
			}
			for _, c := range rep.Cases {
				if c.StatementChecks == 0 || c.StatementOpsPerSec <= 0 || c.StatementP50Us <= 0 || c.StatementP50Us > c.StatementP99Us {
					t.Errorf("%s: the statement path ran no checks, or its percentiles are out of order: %+v", c.Algorithm, c)
				}
				if !isRatioOf(c.StatementP50Ratio, c.StatementP50Us, c.RawP50Us) {
					t.Errorf("%s: statement_p50_ratio %v is not %v/%v", c.Algorithm, c.StatementP50Ratio, c.StatementP50Us, c.RawP50Us)
				}
				if !isRatioOf(c.LibraryOverStatementP50, c.LibraryP50Us, c.StatementP50Us) {
					t.Errorf("%s: library_over_statement_p50 %v is not %v/%v", c.Algorithm, c.LibraryOverStatementP50, c.LibraryP50Us, c.StatementP50Us)
				}
			}
			pool := dbtest.PoolOn(t, schema)
			ctx := context.Background()
			for _, table := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
				var n int
				if err := pool.QueryRow(ctx, "SELECT count(DISTINCT key) FROM "+pgx.Identifier{table}.Sanitize()).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != keys {
					t.Errorf("%s holds %d distinct keys, want %d: the statement path wrote rows of its own", table, n, keys)
				}
			}
			if flag == "--policy" {
				// The library and the statement path send the statement that
				// reads the policy's row alone, which leaves the rows'
				// policy_limit unset. With overrides (of other keys), the
				// library's first check finds them, counts with the statement
				// that reads the key's override, which sets it, and reads the
				// overrides' keys; every later check reads the row alone.
				overrides := 1000
				if len(flags) > 1 {
					overrides = 0
				}
				if rep.PolicyOverrides == nil || *rep.PolicyOverrides != overrides {
					t.Errorf("policy_overrides %v, want %d", rep.PolicyOverrides, overrides)
				}
				var stored, set int
				if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_policy_override").Scan(&stored); err != nil {
					t.Fatal(err)
				}
				if stored != overrides {
					t.Errorf("%d overrides stored, want %d", stored, overrides)
				}
				for _, table := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
					if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{table}.Sanitize()+
						" WHERE policy_limit IS NOT NULL").Scan(&set); err != nil {
						t.Fatal(err)
					}
					if want := min(overrides, 1); set != want {
						t.Errorf("%s: %d rows with policy_limit set, want %d, with %d overrides", table, set, want, overrides)
					}
				}
			}
			if flag == "--request-ids" {
				// Every check of the library and of the statement stored an
				// answer under an id of its own.
				var stored int
				if err := pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_request").Scan(&stored); err != nil {
					t.Fatal(err)
				}
				want := 0
				for _, c := range rep.Cases {
					want += c.LibraryChecks + c.StatementChecks
				}
				if stored < want {
					t.Errorf("pgrl_request holds %d answers, want at least the %d measured checks'", stored, want)
				}
			}
		})
	}
}

func TestBenchTextReport(t *testing.T) {
	schema := dbtest.NewSchema(t)
	code, stdout, stderr := runBench(t,
		"--database-url", dbtest.URL(), "--schema", schema, "--algorithms", "token_bucket",
		"--duration", "100ms", "--warmup", "0s", "--callers", "1", "--keys", "1")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	for _, want := range []string{"raw ops/s", "token_bucket", "pgrl_token_bucket", "Targets:"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
}

func TestBenchUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--algorithms", "leaky_bucket"},
		{"--algorithms", ""},
		{"--callers", "0"},
		{"--keys", "many"},
		{"--duration", "0s"},
		{"--warmup", "-1s"},
		{"--output", "csv"},
		{"--schema", ""},
		{"--max-in-flight", "-1"},
		{"stray"},
		{"--concurrency", "--policy"},
		{"--policy-overrides", "0"},
		{"--policy", "--policy-overrides", "-1"},
		{"--policy", "--policy-overrides", "9223372036854775807"},
		{"--concurrency", "--request-ids"},
		{"--concurrency", "--algorithms", "token_bucket"},
		{"--hold-for", "1s"},
		{"--concurrency", "--hold-window", "10ms"},
		{"--concurrency", "--hold-slots", "0"},
		{"--concurrency", "--hold-keys", "0"},
		{"--concurrency", "--hold-for", "-1s"},
	} {
		code, _, stderr := runBench(t, args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2; stderr: %s", args, code, stderr)
		}
	}
}

func TestBenchUnreachableDatabase(t *testing.T) {
	code, _, stderr := runBench(t, "--database-url", "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2", "--duration", "10ms")
	if code != 1 || !strings.Contains(stderr, "rl-bench:") {
		t.Errorf("exit %d, stderr %q; want exit 1 with an explanation", code, stderr)
	}
}

// isRatioOf reports whether ratio (rounded to 0.001) is num/den, given that
// the report rounds num and den to 0.1. On a busy machine a rate can be as
// low as 16.4/s, where that rounding alone moves the quotient by more than a
// fixed 0.01.
func isRatioOf(ratio, num, den float64) bool {
	slack := ratio*(0.05/num+0.05/den) + 0.001
	return math.Abs(ratio-num/den) <= slack
}

// TestBenchConcurrency: --concurrency measures an acquire (with and
// without its release) against the fixed-window check per case, on the
// rows it populated, and counts the extensions of the slots it holds as
// the keeper's schedule says, through its Databases and in the rows
// written.
func TestBenchConcurrency(t *testing.T) {
	schema := dbtest.NewSchema(t)
	const keys = 20
	code, stdout, stderr := runBench(t,
		"--database-url", dbtest.URL(), "--schema", schema, "--concurrency",
		"--duration", "200ms", "--warmup", "50ms", "--callers", "1,2", "--keys", "20,1",
		// A Window of 1.5s: an extension then has 250ms before the next is
		// due (half the 500ms interval), which a busy machine's fresh
		// connection needs; at 600ms (100ms each) both extensions of a hold
		// sometimes ran out and the slots lapsed.
		"--hold-slots", "1,10", "--hold-keys", "5", "--hold-window", "1500ms", "--hold-for", "2750ms",
		"--output", "json")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	var rep Report
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("output is not one JSON object: %v\n%s", err, stdout)
	}
	if !rep.Concurrency || len(rep.Cases) != 0 || len(rep.ConcurrencyCases) != 4 {
		t.Fatalf("concurrency %v, %d algorithm cases, %d concurrency cases; want 2 callers × 2 key spreads",
			rep.Concurrency, len(rep.Cases), len(rep.ConcurrencyCases))
	}
	for _, c := range rep.ConcurrencyCases {
		if c.AllowChecks == 0 || c.Acquires == 0 || c.AllowOpsPerSec <= 0 || c.AcquireOpsPerSec <= 0 {
			t.Errorf("%+v: a path ran nothing", c)
		}
		if c.AcquireP50Us <= 0 || c.AcquireP50Us > c.AcquireP99Us || c.AcquireReleaseP50Us > c.AcquireReleaseP99Us ||
			c.AllowP50Us <= 0 || c.AllowP50Us > c.AllowP99Us {
			t.Errorf("%+v: percentiles out of order", c)
		}
		if c.AcquireP50Us > c.AcquireReleaseP50Us {
			t.Errorf("%+v: an acquire alone took longer than with its release", c)
		}
		if !isRatioOf(c.AcquireP50Ratio, c.AcquireP50Us, c.AllowP50Us) ||
			!isRatioOf(c.AcquireReleaseP50Ratio, c.AcquireReleaseP50Us, c.AllowP50Us) {
			t.Errorf("%+v: p50 ratios are not acquire/allow", c)
		}
	}

	h := rep.Holds
	if h == nil || len(h.Cases) != 2 || h.IntervalSeconds != 0.5 {
		t.Fatalf("holds: %+v", h)
	}
	var statements int64
	for _, c := range h.Cases {
		// Extensions every 500ms from the first acquire: 5 in 2.75s; on a
		// busy machine a late timer loses one or two at the ends.
		if c.Lost != 0 || c.ExpectedStatements != 5 || c.Statements < 3 || c.Statements > 6 {
			t.Errorf("%+v: want 5 extensions (3 to 6 on a busy machine) and no slot lost", c)
		}
		if c.ExpectedPerSlotPerMinute != loadtest.Round(120/float64(c.Slots), 6) ||
			c.PerSlotPerMinute < 0.75*c.ExpectedPerSlotPerMinute || c.PerSlotPerMinute > 1.1*c.ExpectedPerSlotPerMinute {
			t.Errorf("%+v: per slot per minute, want about 3 per Window of 1.5s over the slots", c)
		}
		statements += int64(c.Statements)
	}
	if h.Statements < statements || h.RowWrites != h.ExpectedRowWrites || h.RowWrites < 2*11+statements {
		t.Errorf("holds: %d statements, %d rows written, %d expected", h.Statements, h.RowWrites, h.ExpectedRowWrites)
	}
	if h.PgStatStatementsCalls == nil && !strings.HasPrefix(h.PgStatStatements, "not read: ") {
		t.Errorf("pg_stat_statements: %q", h.PgStatStatements)
	}

	// The populated rows are the ones the library acquired: one per key of
	// the cases (20), and one per key of the slots held (1 and 5).
	var n int
	pool := dbtest.PoolOn(t, schema)
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pgrl_concurrency").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != keys+1+5 {
		t.Errorf("pgrl_concurrency holds %d rows, want %d: the populated rows and the acquired ones differ", n, keys+6)
	}

	code, stdout, stderr = runBench(t,
		"--database-url", dbtest.URL(), "--schema", schema, "--concurrency",
		"--duration", "100ms", "--warmup", "0s", "--callers", "1", "--keys", "1", "--hold-for", "0s")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	for _, want := range []string{"acquire p50 µs", "acq+rel p50 µs", "allow p50 µs", "pgrl_concurrency", "Targets: HOT"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout, "Slots held") {
		t.Errorf("--hold-for 0 held slots:\n%s", stdout)
	}
}
