package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// envRunAsMain makes the test binary behave as the program, so that the
// children the demo spawns (os.Executable, that is, this test binary) run
// the program's child mode instead of the tests.
const envRunAsMain = "PGRL_MULTIINSTANCE_RUN_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(envRunAsMain) == "1" {
		main()
	}
	os.Exit(m.Run())
}

// runDemo runs the program with args and returns its exit status, stdout
// and stderr.
func runDemo(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	t.Setenv(envRunAsMain, "1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	code := run(ctx, args, strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

func TestDemoJSONEveryAlgorithm(t *testing.T) {
	// An empty schema: the demo must create its tables itself.
	schema := dbtest.NewSchema(t)
	for _, a := range ratelimit.Algorithms {
		t.Run(string(a), func(t *testing.T) {
			code, stdout, stderr := runDemo(t, "--database-url", dbtest.URL(), "--schema", schema, "--output", "json", "--algorithm", string(a))
			if code != 0 {
				t.Fatalf("exit %d; stderr:\n%s", code, stderr)
			}
			var r Result
			if err := json.Unmarshal([]byte(stdout), &r); err != nil {
				t.Fatalf("output is not one JSON object: %v\n%s", err, stdout)
			}
			if r.Algorithm != a || r.Limit != 20 || r.Processes != 4 || r.CallsPerProcess != 50 {
				t.Fatalf("defaults: got algorithm %s, limit %d, processes %d, calls %d", r.Algorithm, r.Limit, r.Processes, r.CallsPerProcess)
			}
			if r.PostgresFallback == nil || *r.PostgresFallback != 0 {
				t.Errorf("postgres_fallback = %v, want 0: PostgreSQL must decide every check\n%s", deref(r.PostgresFallback), stdout)
			}
			if r.PostgresAdmitted == nil || *r.PostgresAdmitted != 20 {
				t.Errorf("postgres_admitted = %v, want exactly the limit, 20\n%s", deref(r.PostgresAdmitted), stdout)
			}
			// Each process's own memory counter admits the limit: 4 × 20.
			if r.MemoryAdmitted == nil || *r.MemoryAdmitted <= 20 || *r.MemoryAdmitted != 80 {
				t.Errorf("memory_admitted = %v, want 80 (each of 4 processes admits 20 on its own)\n%s", deref(r.MemoryAdmitted), stdout)
			}
			if sum(r.PostgresPerProcess) != deref(r.PostgresAdmitted) || len(r.PostgresPerProcess) != 4 {
				t.Errorf("postgres_per_process %v does not add up to %d", r.PostgresPerProcess, deref(r.PostgresAdmitted))
			}
			if sum(r.MemoryPerProcess) != deref(r.MemoryAdmitted) || len(r.MemoryPerProcess) != 4 {
				t.Errorf("memory_per_process %v does not add up to %d", r.MemoryPerProcess, deref(r.MemoryAdmitted))
			}
		})
	}
}

func TestDemoTextTable(t *testing.T) {
	code, stdout, stderr := runDemo(t, "--database-url", dbtest.URL(), "--schema", dbtest.NewSchema(t), "--processes", "2", "--calls", "10", "--limit", "3")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	for _, want := range []string{"2 processes × 10 concurrent calls", "6 of 20 calls got through a limit of 3", "PostgreSQL: 3 of 20"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
}

func TestDemoUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--algorithm", "leaky_bucket"},
		{"--processes", "0"},
		{"--limit", "-1"},
		{"--output", "yaml"},
		{"--rounds", "redis"},
		{"extra"},
	} {
		code, _, stderr := runDemo(t, args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (usage); stderr: %s", args, code, stderr)
		}
	}
}

func TestDemoMissingDatabase(t *testing.T) {
	code, _, stderr := runDemo(t, "--rounds", "postgres", "--database-url", "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2")
	if code != 1 || !strings.Contains(stderr, "multiinstance:") {
		t.Errorf("exit %d, stderr %q; want exit 1 with an explanation", code, stderr)
	}
}

func deref(p *int) int {
	if p == nil {
		return -1
	}
	return *p
}

func sum(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}

func TestDefaultURL(t *testing.T) {
	t.Setenv(envTestURL, "")
	if got := defaultURL(); got != defaultTestURL {
		t.Errorf("defaultURL() = %q, want %q", got, defaultTestURL)
	}
	t.Setenv(envTestURL, "postgres://u@db.example/x")
	if got := defaultURL(); got != "postgres://u@db.example/x" {
		t.Errorf("defaultURL() = %q", got)
	}
}

func TestDemoSchemaFlagChecked(t *testing.T) {
	for _, schema := range []string{"", strings.Repeat("s", 64)} {
		code, _, stderr := runDemo(t, "--schema", schema)
		if code != 2 || !strings.Contains(stderr, "--schema") {
			t.Errorf("--schema %q: exit %d, stderr %q; want a usage error naming --schema", schema, code, stderr)
		}
	}
}

// With DATABASE_URL pointing at a database of the user's own, search_path
// and all, the demo writes only into its own schema, pgrl_demo, and says so;
// --schema picks another.
func TestDemoWritesOnlyIntoItsOwnSchema(t *testing.T) {
	dbURL := dbtest.NewDatabase(t)
	// A user's URL often names the application's schema: the demo leaves it alone too.
	sep := "?"
	if strings.Contains(dbURL, "?") {
		sep = "&"
	}
	t.Setenv("DATABASE_URL", dbURL+sep+"search_path=myapp,public")
	code, stdout, stderr := runDemo(t, "--output", "json", "--processes", "2", "--calls", "5", "--limit", "3")
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	if n := dbtest.ObjectsIn(t, dbURL, "public"); n != 0 {
		t.Errorf("the demo created %d objects in public", n)
	}
	if n := dbtest.ObjectsIn(t, dbURL, DefaultSchema); n == 0 {
		t.Errorf("nothing in schema %s", DefaultSchema)
	}
	var r Result
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, stdout)
	}
	if r.Schema != DefaultSchema || deref(r.PostgresAdmitted) != 3 {
		t.Errorf("schema %q, postgres_admitted %d; want %q and 3\n%s", r.Schema, deref(r.PostgresAdmitted), DefaultSchema, stdout)
	}
	if !strings.Contains(stderr, `multiinstance: migrated schema "pgrl_demo" to version`) {
		t.Errorf("stderr does not name the schema it migrated:\n%s", stderr)
	}

	// Run again: the schema is named once more, now already current.
	code, _, stderr = runDemo(t, "--rounds", "postgres", "--processes", "1", "--calls", "1")
	if code != 0 || !strings.Contains(stderr, `multiinstance: using schema "pgrl_demo"`) {
		t.Errorf("second run: exit %d, stderr:\n%s", code, stderr)
	}

	code, stdout, stderr = runDemo(t, "--schema", "Demo Two", "--output", "json", "--rounds", "postgres", "--processes", "1", "--calls", "2", "--limit", "1")
	if code != 0 {
		t.Fatalf("--schema: exit %d; stderr:\n%s", code, stderr)
	}
	r = Result{}
	if err := json.Unmarshal([]byte(stdout), &r); err != nil || r.Schema != "Demo Two" || deref(r.PostgresAdmitted) != 1 {
		t.Errorf("--schema: %v, result %s", err, stdout)
	}
	if dbtest.ObjectsIn(t, dbURL, "Demo Two") == 0 || dbtest.ObjectsIn(t, dbURL, "public") != 0 || dbtest.ObjectsIn(t, dbURL, "myapp") != 0 {
		t.Error("--schema: the tables are not in the named schema alone")
	}
}
