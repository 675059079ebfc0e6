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
	url := dbtest.URLWithSchema(dbtest.NewSchema(t))
	for _, a := range ratelimit.Algorithms {
		t.Run(string(a), func(t *testing.T) {
			code, stdout, stderr := runDemo(t, "--database-url", url, "--output", "json", "--algorithm", string(a))
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
	url := dbtest.URLWithSchema(dbtest.NewSchema(t))
	code, stdout, stderr := runDemo(t, "--database-url", url, "--processes", "2", "--calls", "10", "--limit", "3")
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
	if got, want := defaultURL(), defaultTestURL+"&search_path=pgrl_demo"; got != want {
		t.Errorf("defaultURL() = %q, want %q", got, want)
	}
	t.Setenv(envTestURL, "postgres://u@db.example/x")
	if got, want := defaultURL(), "postgres://u@db.example/x?search_path=pgrl_demo"; got != want {
		t.Errorf("defaultURL() = %q, want %q", got, want)
	}
	t.Setenv(envTestURL, "postgres://u@db.example/x?search_path=mine")
	if got, want := defaultURL(), "postgres://u@db.example/x?search_path=mine"; got != want {
		t.Errorf("defaultURL() = %q, want %q", got, want)
	}
}

func TestTargetSchema(t *testing.T) {
	for url, want := range map[string]string{
		"postgres://h/d?search_path=pgrl_demo":                "pgrl_demo",
		"postgres://h/d?search_path=a,public":                 "a",
		"postgres://h/d":                                      "",
		"postgres://h/d?search_path=%22My%20Schema%22,public": "My Schema",
	} {
		got, err := targetSchema(url)
		if err != nil || got != want {
			t.Errorf("targetSchema(%q) = %q, %v; want %q", url, got, err, want)
		}
	}
}
