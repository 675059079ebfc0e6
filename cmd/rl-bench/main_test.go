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
