package tests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// rlPolicyRun is one run of the rl-policy binary.
type rlPolicyRun struct {
	args   []string
	code   int
	output string
}

// startRLPolicy starts the rl-policy binary with args against schemaName,
// and returns a function that waits for it.
func startRLPolicy(t *testing.T, bin, schemaName string, args []string) func() rlPolicyRun {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"--database-url", dbtest.URL(), "--schema", schemaName,
		"--lock-timeout", "30s"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	return func() rlPolicyRun {
		err := cmd.Wait()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			code = -1
		}
		return rlPolicyRun{args: args, code: code, output: out.String()}
	}
}

// runTogether starts one rl-policy process per argument list, all at once,
// and waits for every one.
func runTogether(t *testing.T, bin, schemaName string, argLists ...[]string) []rlPolicyRun {
	t.Helper()
	waits := make([]func() rlPolicyRun, len(argLists))
	for i, args := range argLists {
		waits[i] = startRLPolicy(t, bin, schemaName, args)
	}
	runs := make([]rlPolicyRun, len(argLists))
	var wg sync.WaitGroup
	for i, wait := range waits {
		wg.Go(func() { runs[i] = wait() })
	}
	wg.Wait()
	return runs
}

// Five rl-policy set processes started at once, each changing another field
// of one policy, all apply: none overwrites another's field with the value
// it read before that one committed. An override set and an apply of the
// same policy's file run alongside, in other rounds, and apply too.
func TestPolicySetConcurrentProcesses(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-policy")
	schemaName := dbtest.NewSchema(t)
	dbtest.Migrate(t, schemaName)
	pool := dbtest.PoolOn(t, schemaName)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Algorithm: ratelimit.TokenBucket, Limit: 10,
		Window: time.Second, Burst: 20})
	require.NoError(t, err)

	const rounds = 12
	lost := 0
	for round := 1; round <= rounds; round++ {
		limit, window, burst := int64(100+round), time.Duration(round+1)*time.Second, int64(1000+round)
		penalty, desc := round%2 == 1, fmt.Sprintf("round %d", round)
		args := [][]string{
			{"set", "api", "--limit", fmt.Sprint(limit)},
			{"set", "api", "--window", window.String()},
			{"set", "api", "--burst", fmt.Sprint(burst)},
			{"set", "api", fmt.Sprintf("--penalty=%v", penalty)},
			{"set", "api", "--description", desc},
			{"override", "set", "api", fmt.Sprintf("tenant-%d", round), "--limit", fmt.Sprint(round)},
		}
		for i, r := range runTogether(t, bin, schemaName, args...) {
			require.Equal(t, 0, r.code, "round %d, process %d %v: %s", round, i, r.args, r.output)
		}
		p, err := policy.Get(ctx, pool, "api")
		require.NoError(t, err)
		got := []any{p.Limit, p.Window, p.Burst, p.Penalty, p.Description}
		want := []any{limit, window, burst, penalty, desc}
		for i := range want {
			if got[i] != want[i] {
				lost++
				t.Errorf("round %d: the change of %v was lost: the policy holds %v", round, args[i], got[i])
			}
		}
		x, err := policy.Explain(ctx, pool, "api", fmt.Sprintf("tenant-%d", round))
		require.NoError(t, err)
		require.NotNil(t, x.Override, "round %d: the override set alongside was written", round)
		require.Equal(t, int64(round), x.Override.Limit)
	}
	require.Zero(t, lost, "changes lost over %d rounds of 5 concurrent sets", rounds)
}

// rl-policy apply holds the policy table while it plans and writes; a set
// started meanwhile waits for it before it reads, so apply's change is
// never overwritten with what the set read before it.
func TestPolicyApplyAndSetConcurrentProcesses(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-policy")
	schemaName := dbtest.NewSchema(t)
	dbtest.Migrate(t, schemaName)
	pool := dbtest.PoolOn(t, schemaName)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	dir := t.TempDir()
	const rounds = 8
	for round := 1; round <= rounds; round++ {
		file := filepath.Join(dir, fmt.Sprintf("round%d.json", round))
		// apply writes the policy whole, with a new limit; a set of the
		// description alone runs alongside. In either order the limit is
		// apply's: a set that read the policy before apply committed and
		// wrote it after would put the old limit back.
		require.NoError(t, os.WriteFile(file, fmt.Appendf(nil,
			`{"policies": [{"name": "api", "limit": %d, "window": "1m", "description": "round %d"}]}`, 10+round, round), 0o600))
		runs := runTogether(t, bin, schemaName,
			[]string{"apply", file},
			[]string{"set", "api", "--description", fmt.Sprintf("set %d", round)},
			[]string{"set", "other", "--limit", fmt.Sprint(round), "--window", "1s"},
		)
		for i, r := range runs {
			require.Equal(t, 0, r.code, "round %d, process %d %v: %s", round, i, r.args, r.output)
		}
		p, err := policy.Get(ctx, pool, "api")
		require.NoError(t, err)
		require.Equal(t, int64(10+round), p.Limit, "round %d: apply's limit", round)
		require.Contains(t, []string{fmt.Sprintf("round %d", round), fmt.Sprintf("set %d", round)}, p.Description)
		o, err := policy.Get(ctx, pool, "other")
		require.NoError(t, err)
		require.Equal(t, int64(round), o.Limit, "round %d", round)
	}
}

// An override writer holds its policy's row from its check to its write
// (policy.SetOverride). An apply that changes another policy's key mode
// (which locks the override table) and then this policy waits for it before
// it writes anything, rather than deadlocking with its insert: both apply.
func TestPolicyApplyWaitsForOverrideWriter(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-policy")
	schemaName := dbtest.NewSchema(t)
	dbtest.Migrate(t, schemaName)
	pool := dbtest.PoolOn(t, schemaName)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "a", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	b, err := policy.Set(ctx, pool, policy.Policy{Name: "b", Limit: 10, Window: time.Minute})
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "policies.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"policies": [
		{"name": "a", "limit": 10, "window": "1m", "key_mode": "readable"},
		{"name": "b", "limit": 20, "window": "1m"}]}`), 0o600))

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var pid int32
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	// SetOverride's first step, on its own: b's row, held.
	_, err = tx.Exec(ctx, `LOCK TABLE pgrl_policy IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT FROM pgrl_policy WHERE name = 'b' FOR NO KEY UPDATE`)
	require.NoError(t, err)

	wait := startRLPolicy(t, bin, schemaName, []string{"apply", file})
	done := make(chan rlPolicyRun, 1)
	go func() { done <- wait() }()
	require.Eventually(t, func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 5*time.Millisecond, "apply waits for the override writer")
	// The rest of SetOverride: its write, then the commit.
	_, err = policy.SetOverride(ctx, tx, policy.Override{Policy: "b", Key: b.StoredKey("tenant-1"), Limit: 5})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	r := <-done
	require.Equal(t, 0, r.code, r.output)

	p, err := policy.Get(ctx, pool, "a")
	require.NoError(t, err)
	require.Equal(t, ratelimit.ReadableKeys, p.KeyMode)
	x, err := policy.Explain(ctx, pool, "b", "tenant-1")
	require.NoError(t, err)
	require.Equal(t, int64(20), x.Policy.Limit)
	require.NotNil(t, x.Override)
	require.Equal(t, int64(5), x.Rate.Limit)
}
