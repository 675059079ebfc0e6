// Package tests holds pgrl's cross-package tests: several OS processes
// against one database, fault injection, the command-line tools end to end.
package tests

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// The multi-instance experiment: multiprocessProcesses OS processes
// each fire multiprocessCalls concurrent checks at one key whose limit is
// multiprocessLimit; exactly the limit must get through, in every trial.
const (
	multiprocessProcesses = 4
	multiprocessCalls     = 50
	multiprocessLimit     = 20
	multiprocessTrials    = 20
)

// multiprocessTrialCount is multiprocessTrials, or 4 with -short (the CI
// matrix runs these tests on every PostgreSQL major with -short; the full
// suite runs all 20 trials).
func multiprocessTrialCount() int {
	if testing.Short() {
		return 4
	}
	return multiprocessTrials
}

// multiprocessDemoResult is the part of examples/multiinstance's JSON output
// these tests read.
type multiprocessDemoResult struct {
	Algorithm          string `json:"algorithm"`
	Limit              int64  `json:"limit"`
	Processes          int    `json:"processes"`
	CallsPerProcess    int    `json:"calls_per_process"`
	LimiterName        string `json:"limiter_name"`
	Key                string `json:"key"`
	PostgresAdmitted   *int   `json:"postgres_admitted"`
	PostgresPerProcess []int  `json:"postgres_per_process"`
}

// multiprocessRun runs one trial: the demo's PostgreSQL round only, on key,
// with its tables in schema.
func multiprocessRun(t *testing.T, bin, schema string, a ratelimit.Algorithm, key string, penalty bool) multiprocessDemoResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin,
		"--rounds", "postgres",
		"--output", "json",
		"--database-url", dbtest.URL(),
		"--schema", schema,
		"--algorithm", string(a),
		"--processes", fmt.Sprint(multiprocessProcesses),
		"--calls", fmt.Sprint(multiprocessCalls),
		"--limit", fmt.Sprint(multiprocessLimit),
		"--key", key,
		fmt.Sprintf("--penalty=%t", penalty),
	)
	out, err := cmd.Output()
	if err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			t.Fatalf("demo failed: %v\n%s", err, exitErr.Stderr)
		}
		t.Fatalf("demo failed: %v", err)
	}
	var r multiprocessDemoResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("demo output is not JSON: %v\n%s", err, out)
	}
	if r.PostgresAdmitted == nil || len(r.PostgresPerProcess) != multiprocessProcesses {
		t.Fatalf("demo output lacks the per-process postgres counts:\n%s", out)
	}
	sum := 0
	for _, n := range r.PostgresPerProcess {
		sum += n
	}
	if sum != *r.PostgresAdmitted {
		t.Fatalf("per-process counts %v do not add up to %d", r.PostgresPerProcess, *r.PostgresAdmitted)
	}
	return r
}

// multiprocessHashedKey is the key column's value for a limiter name and a
// key under ratelimit.HashedKeys, computed independently of the library:
// the first 16 bytes of SHA-256(uvarint(len(name)) || name || key).
func multiprocessHashedKey(name, key string) []byte {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(name)))])
	h.Write([]byte(name))
	h.Write([]byte(key))
	return h.Sum(nil)[:16]
}

// TestMultiprocessExactlyTheLimit: 4 OS processes × 50 concurrent calls on one
// key with a limit of 20 admit exactly 20 in total, in each of 20 trials, for
// every algorithm (the token bucket with capacity 20 and negligible refill).
func TestMultiprocessExactlyTheLimit(t *testing.T) {
	bin := buildCommand(t, "github.com/pgrl/pgrl/examples/multiinstance")
	// An empty schema: the first trial migrates it, as the demo does.
	schema := dbtest.NewSchema(t)
	for _, a := range ratelimit.Algorithms {
		t.Run(string(a), func(t *testing.T) {
			for trial := range multiprocessTrialCount() {
				r := multiprocessRun(t, bin, schema, a, fmt.Sprintf("exact-%s-%d", a, trial), false)
				if *r.PostgresAdmitted != multiprocessLimit {
					t.Errorf("trial %d: %d admitted (per process %v), want exactly %d",
						trial+1, *r.PostgresAdmitted, r.PostgresPerProcess, multiprocessLimit)
				}
			}
		})
	}
}

// TestMultiprocessPenaltyCountsEveryAttempt: in penalty mode the same
// experiment still admits exactly 20, and the fixed-window counter row reads
// exactly 200 afterwards: not one of the concurrent increments was lost.
func TestMultiprocessPenaltyCountsEveryAttempt(t *testing.T) {
	bin := buildCommand(t, "github.com/pgrl/pgrl/examples/multiinstance")
	schema := dbtest.NewSchema(t)
	pool := dbtest.PoolOn(t, schema)
	ctx := context.Background()
	const attempts = multiprocessProcesses * multiprocessCalls
	for trial := range multiprocessTrialCount() {
		key := fmt.Sprintf("penalty-%d", trial)
		r := multiprocessRun(t, bin, schema, ratelimit.FixedWindow, key, true)
		if *r.PostgresAdmitted != multiprocessLimit {
			t.Errorf("trial %d: %d admitted (per process %v), want exactly %d",
				trial+1, *r.PostgresAdmitted, r.PostgresPerProcess, multiprocessLimit)
		}
		var rows int
		var count int64
		err := pool.QueryRow(ctx,
			"SELECT count(*), coalesce(sum(count), 0)::bigint FROM pgrl_fixed_window WHERE key = $1",
			multiprocessHashedKey(r.LimiterName, r.Key)).Scan(&rows, &count)
		if err != nil {
			t.Fatal(err)
		}
		if rows != 1 || count != attempts {
			t.Errorf("trial %d: %d counter rows reading %d in total, want one row reading exactly %d", trial+1, rows, count, attempts)
		}
	}
}
