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
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
)

// runFn calls run directly and returns stdout, stderr and the exit code.
func runFn(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	code := run(ctx, args, &stdout, &stderr)
	return stdout.String(), stderr.String(), code
}

// db returns the flags that point rl-policy at the test database and schema.
func db(schemaName string, more ...string) []string {
	return append([]string{"--database-url", dbtest.URL(), "--schema", schemaName}, more...)
}

// jsonDB is db with --output json.
func jsonDB(schemaName string, more ...string) []string {
	return db(schemaName, append([]string{"--output", "json"}, more...)...)
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

func TestPolicyLifecycle(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)

	stdout, stderr, code := runFn(t, jsonDB(s, "set", "api", "--limit", "100", "--window", "1m", "--description", "public API")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	out := oneJSON(t, stdout)
	require.Equal(t, true, out["created"])
	require.Equal(t, float64(60), out["policy"].(map[string]any)["window_seconds"])

	// Changing one field keeps the others.
	stdout, stderr, code = runFn(t, db(s, "set", "api", "--limit", "200", "--algorithm", "token_bucket", "--burst", "300")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "updated policy api: token_bucket, 200 per 1m0s, burst 300")
	stdout, _, code = runFn(t, jsonDB(s, "get", "api")...)
	require.Equal(t, cli.ExitOK, code)
	p := oneJSON(t, stdout)["policy"].(map[string]any)
	require.Equal(t, "public API", p["description"])
	require.Equal(t, float64(300), p["burst"])

	_, stderr, code = runFn(t, db(s, "set", "login", "--limit", "5", "--window", "15m", "--penalty", "--key-mode", "readable")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	stdout, _, code = runFn(t, db(s, "list")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "NAME")
	require.Contains(t, stdout, "login  fixed_window")

	// Overrides: by key, readable keys shown as text.
	stdout, stderr, code = runFn(t, jsonDB(s, "override", "set", "login", "ada@example.com", "--limit", "50", "--expires-in", "1h", "--note", "support ticket 7")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	o := oneJSON(t, stdout)["override"].(map[string]any)
	require.Equal(t, "ada@example.com", o["key"])
	require.Equal(t, false, o["expired"])
	_, stderr, code = runFn(t, db(s, "override", "set", "api", "tenant-42", "--limit", "1000", "--burst", "2000")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	stdout, _, code = runFn(t, jsonDB(s, "override", "list")...)
	require.Equal(t, cli.ExitOK, code)
	require.Len(t, oneJSON(t, stdout)["overrides"], 2)
	stdout, _, code = runFn(t, db(s, "override", "list", "login")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, `"ada@example.com"`)
	require.Contains(t, stdout, "support ticket 7")

	// Explain: the override in force, the rate, the counter.
	stdout, stderr, code = runFn(t, jsonDB(s, "explain", "api", "tenant-42")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	x := oneJSON(t, stdout)
	require.Equal(t, float64(2000), x["rate"].(map[string]any)["burst"])
	require.Equal(t, float64(2000), x["counter"].(map[string]any)["remaining"])
	require.NotNil(t, x["override"])
	stdout, _, code = runFn(t, db(s, "explain", "api", "someone-else")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "override   none: the policy applies")
	require.Contains(t, stdout, "applies    200 per 1m0s, burst 300")
	// A fixed window has no burst: explain shows none.
	stdout, _, code = runFn(t, db(s, "explain", "login", "ada@example.com")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "override   limit 50, window (policy's), expires at")
	require.Contains(t, stdout, "applies    50 per 15m0s\n")
	require.NotContains(t, stdout, "burst")
	stdout, _, code = runFn(t, jsonDB(s, "explain", "login", "bob@example.com")...)
	require.Equal(t, cli.ExitOK, code)
	rate := oneJSON(t, stdout)["rate"].(map[string]any)
	require.Contains(t, rate, "burst")
	require.Nil(t, rate["burst"], "a fixed window has no burst")

	// Delete an override by its stored key, then a policy (and its overrides).
	stdout, _, code = runFn(t, jsonDB(s, "override", "list", "api")...)
	require.Equal(t, cli.ExitOK, code)
	keyHex := oneJSON(t, stdout)["overrides"].([]any)[0].(map[string]any)["key_hex"].(string)
	_, stderr, code = runFn(t, db(s, "override", "delete", "api", "--stored-key", keyHex)...)
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = runFn(t, db(s, "override", "delete", "api", "tenant-42")...)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, stderr, "no override")
	_, stderr, code = runFn(t, db(s, "delete", "login")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	stdout, _, code = runFn(t, jsonDB(s, "override", "list")...)
	require.Equal(t, cli.ExitOK, code)
	require.Empty(t, oneJSON(t, stdout)["overrides"])
	stdout, _, code = runFn(t, jsonDB(s, "delete", "login")...)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, oneJSON(t, stdout)["error"], `no policy is named "login"`)
}

// Bad input exits 2 with one line that names the fix, and writes nothing.
func TestBadInputWritesNothing(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"set", "api", "--limit", "0", "--window", "1m"}, "the limit must be at least 1"},
		{[]string{"set", "api", "--limit", "5"}, "give --limit and --window to create it"},
		{[]string{"set", "api", "--limit", "5", "--window", "720h", "--algorithm", "leaky"}, "use fixed_window, token_bucket or sliding_window"},
		{[]string{"set", "api", "--limit", "5", "--window", "9000h"}, "use a window between"},
		{[]string{"set", "has space", "--limit", "5", "--window", "1m"}, "a policy name is 1 to 128 characters"},
		{[]string{"set", "api", "--limit", "5", "--window", "1m", "--key-mode", "plain"}, "--key-mode must be hashed or readable"},
		{[]string{"set"}, "set takes one argument"},
		{[]string{"explain", "api"}, "explain takes two arguments"},
		{[]string{"override", "set", "api", "k"}, "at least one of --limit, --window and --burst"},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-at", "tomorrow"}, "use RFC 3339"},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-at", "2020-01-01T00:00:00Z"}, "is in the past, so the override would never apply: give a later instant"},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-at", time.Now().Add(-time.Second).UTC().Format(time.RFC3339)}, "rl-policy override delete api KEY"},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-in", "0s"}, "--expires-in must be a positive duration such as 24h"},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-in", "-1h"}, "--expires-in must be a positive duration such as 24h"},
		{[]string{"set", "api", "--limit", "5", "--window", "1d"}, `invalid value "1d" for flag -window: not a duration: use a duration such as 90s, 15m or 24h`},
		{[]string{"override", "set", "api", "k", "--limit", "1", "--expires-in", "soon"}, "use a duration such as 90s, 15m or 24h"},
		{[]string{"--lock-timeout", "5", "list"}, "use a duration such as 90s, 15m or 24h"},
		{[]string{"set", "api", "--limit", "lots", "--window", "1m"}, "not a whole number: use a number such as 100"},
		{[]string{"set", "api", "--limit", "99999999999999999999", "--window", "1m"}, "out of range"},
		{[]string{"override", "frob"}, "unknown override subcommand"},
		{[]string{"frob"}, `unknown command "frob"`},
		{[]string{"--output", "yaml", "list"}, "--output must be text or json"},
	} {
		stdout, stderr, code := runFn(t, db(s, tc.args...)...)
		require.Equal(t, cli.ExitUsage, code, "%v: %s", tc.args, stderr)
		require.Empty(t, stdout)
		require.Contains(t, stderr, tc.want, tc.args)
		require.NotContains(t, stderr, "parse error", tc.args)
		require.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
	}
	// An override the policy's algorithm cannot hold, and one of a missing policy.
	_, stderr, code := runFn(t, db(s, "set", "tb", "--limit", "1", "--window", "8000h", "--algorithm", "token_bucket")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = runFn(t, db(s, "override", "set", "tb", "k", "--burst", "9007199254740992")...)
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, stderr, "more than 1,000 years to refill")
	// A stored key that no key is stored as under the policy's key mode.
	_, stderr, code = runFn(t, db(s, "override", "set", "tb", "--stored-key", "74656e616e742d39", "--limit", "3")...)
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, stderr, "--stored-key 74656e616e742d39 is not a stored key of policy tb, whose keys are hashed, so the override would never apply")
	require.Contains(t, stderr, "give the key itself as the KEY argument")
	stdout, _, code := runFn(t, jsonDB(s, "override", "set", "missing", "k", "--limit", "3")...)
	require.Equal(t, cli.ExitError, code)
	e := oneJSON(t, stdout)
	require.Contains(t, e["error"], `no policy is named "missing"`)
	require.Equal(t, float64(cli.ExitError), e["exit_code"])

	stdout, _, code = runFn(t, jsonDB(s, "list")...)
	require.Equal(t, cli.ExitOK, code)
	require.Len(t, oneJSON(t, stdout)["policies"], 1, "only tb was written")
	stdout, _, code = runFn(t, jsonDB(s, "override", "list")...)
	require.Equal(t, cli.ExitOK, code)
	require.Empty(t, oneJSON(t, stdout)["overrides"])
}

// Without migration 7 the error says to run rl-migrate up; an unreachable
// database is exit 1 too.
func TestNotMigratedAndUnreachable(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	_, stderr, code := runFn(t, db(s, "list")...)
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, stderr, "rl-migrate up")
	// It names where it looked: the schema, the database and the user.
	require.Contains(t, stderr, fmt.Sprintf("missing in schema %q of database", s))
	require.Contains(t, stderr, `(user "`)
	_, stderr, code = runFn(t, "--database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2", "list")
	require.Equal(t, cli.ExitError, code)
	require.Contains(t, stderr, "cannot reach the database")
}

// The binary reads DATABASE_URL like rl-migrate, and --help exits 0.
func TestBinaryEnvAndHelp(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	dir := t.TempDir()
	bin := filepath.Join(dir, "rl-policy")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	cmd := exec.Command(bin, "--schema", s, "set", "env", "--limit", "3", "--window", "10s")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir(), "DATABASE_URL=" + dbtest.URL()}
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "created policy env")

	stdout, _, code := runFn(t, "--help")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "Exit codes:")
	stdout, _, code = runFn(t, "--output", "json", "--help")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, oneJSON(t, stdout)["usage"], "rl-policy")
}

// apply makes the stored policies those of a file, in one transaction: the
// output of list round-trips, --dry-run changes nothing, --prune deletes,
// and a bad file writes nothing.
func TestApply(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
		return p
	}
	_, stderr, code := runFn(t, db(s, "set", "old", "--limit", "1", "--window", "1h")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = runFn(t, db(s, "set", "api", "--limit", "100", "--window", "1m")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	_, stderr, code = runFn(t, db(s, "override", "set", "old", "k", "--limit", "5")...)
	require.Equal(t, cli.ExitOK, code, stderr)

	// list's output applies as is: nothing to change.
	stdout, _, code := runFn(t, jsonDB(s, "list")...)
	require.Equal(t, cli.ExitOK, code)
	stdout, stderr, code = runFn(t, db(s, "apply", write("same.json", stdout))...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "nothing to change")

	want := write("want.json", `{"policies": [
		{"name": "api", "limit": 200, "window": "1m"},
		{"name": "uploads", "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 50, "description": "bytes"}]}`)
	stdout, stderr, code = runFn(t, db(s, "apply", want, "--prune", "--dry-run")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "update api: fixed_window, 100 per 1m0s, hashed keys -> fixed_window, 200 per 1m0s, hashed keys")
	require.Contains(t, stdout, "create uploads: token_bucket, 10 per 1s, burst 50, hashed keys")
	require.Contains(t, stdout, "delete old")
	require.Contains(t, stdout, "dry run: 3 changes, none made")
	stdout, _, _ = runFn(t, jsonDB(s, "list")...)
	require.Len(t, oneJSON(t, stdout)["policies"], 2, "the dry run changed nothing")

	stdout, stderr, code = runFn(t, jsonDB(s, "apply", want, "--prune")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	res := oneJSON(t, stdout)
	require.Equal(t, false, res["dry_run"])
	require.Len(t, res["changes"], 3)
	stdout, _, _ = runFn(t, jsonDB(s, "list")...)
	ps := oneJSON(t, stdout)["policies"].([]any)
	require.Len(t, ps, 2)
	require.Equal(t, "api", ps[0].(map[string]any)["name"])
	require.Equal(t, float64(200), ps[0].(map[string]any)["limit"])
	require.Equal(t, "bytes", ps[1].(map[string]any)["description"])
	stdout, _, _ = runFn(t, jsonDB(s, "override", "list")...)
	require.Empty(t, oneJSON(t, stdout)["overrides"], "deleted with its policy")
	stdout, _, code = runFn(t, db(s, "apply", want, "--prune")...)
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, stdout, "nothing to change")

	// A change of the description alone shows in the dry run; one change is
	// one change.
	desc := write("desc.json", `{"policies": [
		{"name": "api", "limit": 200, "window": "1m", "description": "public API, per key"},
		{"name": "uploads", "algorithm": "token_bucket", "limit": 10, "window": "1s", "burst": 50, "description": "bytes"}]}`)
	stdout, stderr, code = runFn(t, db(s, "apply", desc, "--dry-run")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, `update api: description "" -> "public API, per key" (limit unchanged: fixed_window, 200 per 1m0s, hashed keys)`)
	require.Contains(t, stdout, "dry run: 1 change, none made\n")
	stdout, stderr, code = runFn(t, db(s, "apply", desc)...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "applied 1 change in one transaction\n")
	stdout, stderr, code = runFn(t, db(s, "apply", write("two.json", `{"policies": [
		{"name": "api", "limit": 300, "window": "1m"},
		{"name": "uploads", "algorithm": "token_bucket", "limit": 20, "window": "1s", "burst": 50, "description": "bytes"}]}`))...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, `update api: fixed_window, 200 per 1m0s, hashed keys -> fixed_window, 300 per 1m0s, hashed keys; description "public API, per key" -> ""`)
	require.Contains(t, stdout, "applied 2 changes in one transaction\n")

	// Bad files: exit 2, nothing written.
	for _, tc := range []struct{ body, want string }{
		{`{"policies": [{"name": "api", "limit": 1, "window": "1m", "penalti": true}]}`,
			`policy 0 ("api"): unknown field "penalti" (did you mean "penalty"?); a policy's fields are name, algorithm, limit, window, burst, penalty, key_mode, description`},
		{`{"policies": [{"name": "api", "limit": 1, "window": "1m", "owner": "team-a"}]}`, `unknown field "owner"; a policy's fields are`},
		{`{"policies": [], "prune": true}`, `unknown field "prune" at the top`},
		{`{"policies": []} {"policies": []}`, "more than one JSON value"},
		{`{"policies": [{"name": "api", "limit": 0, "window": "1m"}]}`, "the limit must be at least 1"},
		{`{"policies": [{"name": "x", "limit": 1, "window": "1m"}, {"name": "x", "limit": 2, "window": "1m"}]}`, "given twice"},
		{`{"policies": [{"name": "x", "limit": 1, "window": "a minute"}]}`, "not a duration"},
		{`{"policy": []}`, `unknown field "policy" at the top (did you mean "policies"?)`},
		{`{}`, `no "policies" array`},
		{`not json`, "is not a JSON object"},
	} {
		stdout, stderr, code := runFn(t, db(s, "apply", write("bad.json", tc.body), "--prune")...)
		require.Equal(t, cli.ExitUsage, code, "%s: %s", tc.body, stderr)
		require.Empty(t, stdout)
		require.Contains(t, stderr, tc.want)
	}
	stdout, _, _ = runFn(t, jsonDB(s, "list")...)
	require.Len(t, oneJSON(t, stdout)["policies"], 2)
}
