package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// keySetup is a schema migrated by rl-migrate's code with --grant-to naming
// a fresh application role, which has only the rights docs/SECURITY.md
// gives it (DML on the counters, SELECT on the policy tables).
type keySetup struct {
	schema string
	app    string
	pool   *pgxpool.Pool // as the application role
}

func newKeySetup(t *testing.T) keySetup {
	t.Helper()
	ctx := context.Background()
	ks := keySetup{schema: dbtest.NewSchema(t), app: dbtest.NewRole(t)}
	m, err := migration.New(dbtest.URL(), migration.Config{Schema: ks.schema, GrantTo: []string{ks.app}})
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.NoError(t, err)
	require.NoError(t, m.Close())
	ks.pool, err = pgxpool.New(ctx, dbtest.URLAsWithSchema(ks.app, ks.schema))
	require.NoError(t, err)
	t.Cleanup(ks.pool.Close)
	return ks
}

// asApp runs rl-policy as the application role, with --output json.
func (ks keySetup) asApp(t *testing.T, args ...string) (map[string]any, string, int) {
	t.Helper()
	stdout, stderr, code := runFn(t, append([]string{"--database-url", dbtest.URLAs(ks.app), "--schema", ks.schema, "--output", "json"}, args...)...)
	return oneJSON(t, stdout), stderr, code
}

// asAppText is asApp with text output.
func (ks keySetup) asAppText(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	return runFn(t, append([]string{"--database-url", dbtest.URLAs(ks.app), "--schema", ks.schema}, args...)...)
}

func counter(t *testing.T, out map[string]any) map[string]any {
	t.Helper()
	c, ok := out["counter"].(map[string]any)
	require.True(t, ok, "no counter in %v", out)
	return c
}

// A window long enough that no test run crosses a window's end or sees a
// token refill: the counts read are exactly the counts made.
const keyWindow = 8760 * time.Hour

// A limiter defined in code consumes 3 of 5; under the application role
// `key get` shows used=3 and the stored key, `key reset` deletes the row and
// the limiter has 5 again; a second reset finds nothing (exit 0). Each
// algorithm.
func TestKeyCodeLimiter(t *testing.T) {
	t.Parallel()
	ks := newKeySetup(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			name, key := "login:"+string(alg), "ada@example.com"
			lim, err := testkit.New(ks.pool, ratelimit.Config{Name: name, Algorithm: alg, Limit: 5, Window: keyWindow, OnFailure: ratelimit.FailError})
			require.NoError(t, err)
			for range 3 {
				d, err := lim.Allow(ctx, key)
				require.NoError(t, err)
				require.True(t, d.Allowed)
			}
			shape := []string{"--algorithm", string(alg), "--limit", "5", "--window", keyWindow.String()}

			out, stderr, code := ks.asApp(t, append([]string{"key", "get", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, "key get", out["command"])
			require.Equal(t, "flags", out["source"])
			require.Equal(t, key, out["key"])
			require.Equal(t, hex.EncodeToString(ratelimit.StoredKey(ratelimit.HashedKeys, name, key)), out["stored_key_hex"])
			c := counter(t, out)
			require.Equal(t, true, c["exists"])
			require.Equal(t, float64(1), c["rows"])
			require.Equal(t, float64(3), c["used"])
			require.Equal(t, float64(2), c["remaining"])
			require.Equal(t, float64(5), c["limit"])
			require.Equal(t, true, c["allowed"])
			require.Equal(t, float64(0), c["retry_after_seconds"])
			resetAt, err := time.Parse(time.RFC3339Nano, c["reset_at"].(string))
			require.NoError(t, err)
			require.True(t, resetAt.After(time.Now()), "reset_at %v", resetAt)

			text, stderr, code := ks.asAppText(t, append([]string{"key", "get", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Contains(t, text, "counter    used 3 of 5, 2 remaining")
			require.Contains(t, text, `key        "ada@example.com" (stored as `)

			out, stderr, code = ks.asApp(t, append([]string{"key", "reset", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, true, out["existed"])
			require.Equal(t, float64(1), out["deleted_rows"])
			d, err := lim.Peek(ctx, key)
			require.NoError(t, err)
			require.Equal(t, int64(5), d.Remaining)
			d, err = lim.Allow(ctx, key, ratelimit.Cost(5))
			require.NoError(t, err)
			require.True(t, d.Allowed, "the limiter has 5 again after the reset")

			// Idempotent: a second reset finds nothing and succeeds.
			out, stderr, code = ks.asApp(t, append([]string{"key", "reset", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, true, out["existed"], "the check above made a row")
			for range 2 {
				out, stderr, code = ks.asApp(t, append([]string{"key", "reset", name, key}, shape...)...)
				require.Equal(t, cli.ExitOK, code, stderr)
				require.Equal(t, false, out["existed"])
				require.Equal(t, float64(0), out["deleted_rows"])
			}
			text, _, code = ks.asAppText(t, append([]string{"key", "reset", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code)
			require.Contains(t, text, "nothing to delete")
			out, _, code = ks.asApp(t, append([]string{"key", "get", name, key}, shape...)...)
			require.Equal(t, cli.ExitOK, code)
			require.Equal(t, false, counter(t, out)["exists"])
			require.Equal(t, float64(0), counter(t, out)["used"])
		})
	}
}

// The same for a stored policy, whose shape comes from pgrl_policy (its
// counters are keyed by window) and whose override for the key applies.
func TestKeyStoredPolicy(t *testing.T) {
	t.Parallel()
	ks := newKeySetup(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			name, key := "api-"+string(alg), "tenant-42"
			// Policies are written as the owner (the application role only reads them).
			_, stderr, code := runFn(t, db(ks.schema, "set", name, "--limit", "5", "--window", keyWindow.String(), "--algorithm", string(alg))...)
			require.Equal(t, cli.ExitOK, code, stderr)
			lim, err := policy.NewLimiter(ctx, ks.pool, name, policy.Options{Config: ratelimit.Config{OnFailure: ratelimit.FailError}})
			require.NoError(t, err)
			for range 3 {
				d, err := lim.Allow(ctx, key)
				require.NoError(t, err)
				require.True(t, d.Allowed)
			}

			out, stderr, code := ks.asApp(t, "key", "get", name, key)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, "policy", out["source"])
			require.Equal(t, string(alg), out["limiter"].(map[string]any)["algorithm"])
			counterName := ratelimit.RateName(name, keyWindow)
			if alg == ratelimit.TokenBucket {
				counterName = name
			}
			require.Equal(t, hex.EncodeToString(ratelimit.StoredKey(ratelimit.HashedKeys, counterName, key)), out["stored_key_hex"])
			c := counter(t, out)
			require.Equal(t, true, c["exists"])
			require.Equal(t, float64(3), c["used"])
			require.Equal(t, float64(2), c["remaining"])

			// Shape flags would describe another limiter: refused.
			_, stderr, code = ks.asAppText(t, "key", "get", name, key, "--limit", "5")
			require.Equal(t, cli.ExitUsage, code)
			require.Contains(t, stderr, "is a stored policy, whose shape comes from pgrl_policy: drop --limit")

			out, stderr, code = ks.asApp(t, "key", "reset", name, key)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, true, out["existed"])
			d, err := lim.Allow(ctx, key, ratelimit.Cost(5))
			require.NoError(t, err)
			require.True(t, d.Allowed, "the policy's limiter has 5 again after the reset")

			// An override in force gives the key's limit.
			_, stderr, code = runFn(t, db(ks.schema, "override", "set", name, key, "--limit", "7")...)
			require.Equal(t, cli.ExitOK, code, stderr)
			out, stderr, code = ks.asApp(t, "key", "get", name, key)
			require.Equal(t, cli.ExitOK, code, stderr)
			require.Equal(t, float64(7), counter(t, out)["limit"])
			require.Equal(t, float64(7), out["override"].(map[string]any)["limit"])
		})
	}
}

// Keys of any bytes: --key-hex reaches a key with NUL and invalid UTF-8,
// with readable keys the stored form is "name:key"; a 1 MB hashed key works;
// Spread and KeyByWindow reach the rows the library uses.
func TestKeyAnyBytesAndRows(t *testing.T) {
	t.Parallel()
	ks := newKeySetup(t)
	ctx := context.Background()

	key := "\x00\xffbin"
	lim, err := testkit.New(ks.pool, ratelimit.Config{Name: "raw", Limit: 5, Window: keyWindow, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)
	_, err = lim.Allow(ctx, key, ratelimit.Cost(2))
	require.NoError(t, err)
	out, stderr, code := ks.asApp(t, "key", "get", "raw", "--key-hex", hex.EncodeToString([]byte(key)), "--limit", "5", "--window", keyWindow.String(), "--key-mode", "readable")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(2), counter(t, out)["used"])
	require.Nil(t, out["key"], "not UTF-8: only key_hex")
	require.Equal(t, hex.EncodeToString([]byte("raw:"+key)), out["stored_key_hex"])
	text, _, code := ks.asAppText(t, "key", "get", "raw", "--key-hex", `\x00ff62696e`, "--limit", "5", "--window", keyWindow.String(), "--key-mode", "readable")
	require.Equal(t, cli.ExitOK, code)
	require.Contains(t, text, "key        hex 00ff62696e")

	// The empty key itself, by --key-hex ''.
	_, err = lim.Allow(ctx, "")
	require.NoError(t, err)
	out, stderr, code = ks.asApp(t, "key", "get", "raw", "--key-hex", "", "--limit", "5", "--window", keyWindow.String(), "--key-mode", "readable")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(1), counter(t, out)["used"])

	big := strings.Repeat("k", 1<<20)
	out, stderr, code = ks.asApp(t, "key", "get", "big", big, "--limit", "5", "--window", "1m")
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(5), counter(t, out)["remaining"])

	// The largest limit computes exactly.
	stdout, stderr, code := runFn(t, "--database-url", dbtest.URLAs(ks.app), "--schema", ks.schema, "--output", "json",
		"key", "get", "max", "k", "--limit", strconv.FormatInt(math.MaxInt64, 10), "--window", "1m")
	require.Equal(t, cli.ExitOK, code, stderr)
	var exact struct {
		Counter struct{ Remaining json.Number } `json:"counter"`
	}
	dec := json.NewDecoder(strings.NewReader(stdout))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&exact))
	require.Equal(t, strconv.FormatInt(math.MaxInt64, 10), exact.Counter.Remaining.String())

	// Spread over 3 rows and keyed by window: every row is read and deleted.
	spread, err := testkit.New(ks.pool, ratelimit.Config{Name: "global", Limit: 9, Window: keyWindow, Spread: 3, KeyByWindow: true, OnFailure: ratelimit.FailError})
	require.NoError(t, err)
	for range 6 {
		d, err := spread.Allow(ctx, "all")
		require.NoError(t, err)
		require.True(t, d.Allowed)
	}
	flags := []string{"--limit", "9", "--window", keyWindow.String(), "--spread", "3", "--key-by-window"}
	out, stderr, code = ks.asApp(t, append([]string{"key", "get", "global", "all"}, flags...)...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(6), counter(t, out)["used"])
	require.Equal(t, float64(3), counter(t, out)["rows"])
	require.Len(t, out["stored_keys_hex"], 3)
	out, stderr, code = ks.asApp(t, append([]string{"key", "reset", "global", "all"}, flags...)...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Equal(t, float64(3), out["deleted_rows"])
	d, err := spread.Peek(ctx, "all")
	require.NoError(t, err)
	require.Equal(t, int64(9), d.Remaining)
}

// Hostile input is a usage error (exit 2) of one line that names the fix,
// and nothing is counted or deleted.
func TestKeyBadInput(t *testing.T) {
	t.Parallel()
	ks := newKeySetup(t)
	ctx := context.Background()
	lim, err := testkit.New(ks.pool, ratelimit.Config{Name: "n", Limit: 5, Window: keyWindow})
	require.NoError(t, err)
	_, err = lim.Allow(ctx, "k")
	require.NoError(t, err)
	_, stderr, code := runFn(t, db(ks.schema, "set", "pol", "--limit", "5", "--window", "1m")...)
	require.Equal(t, cli.ExitOK, code, stderr)

	w := []string{"--window", "1m"}
	l := []string{"--limit", "5"}
	cat := func(parts ...[]string) []string {
		var out []string
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"key"}, "key needs a subcommand: get or reset"},
		{[]string{"key", "del", "n", "k"}, `unknown key subcommand "del"`},
		{[]string{"key", "get", "n"}, "key get takes two arguments"},
		{[]string{"key", "get", "n", "k", "extra"}, "key get takes two arguments"},
		{[]string{"key", "get", "n", ""}, "KEY is empty"},
		{[]string{"key", "get", "", "k"}, "NAME is empty"},
		{[]string{"key", "get", "n", "k", "--key-hex", "6b"}, "without a KEY argument"},
		{[]string{"key", "reset", "n", "--key-hex", "zz"}, `--key-hex "zz" is not hexadecimal`},
		{[]string{"key", "get", "n", "k"}, `"n" is not a stored policy; for a limiter defined in code give its shape as in its ratelimit.Config: --limit N --window D`},
		{cat([]string{"key", "reset", "n", "k"}, l), "--window D"},
		{cat([]string{"key", "get", "bad\x00name", "k"}, w), "--limit N"},
		{cat([]string{"key", "get", "n", "k", "--limit", "-1"}, w), `--limit "-1": give the limiter's Config.Limit, a whole number from 1 to 9223372036854775807`},
		{cat([]string{"key", "get", "n", "k", "--limit", "9223372036854775808"}, w), "a whole number from 1 to"},
		{cat([]string{"key", "get", "n", "k", "--limit", "five"}, w), "a whole number from 1 to"},
		{cat([]string{"key", "get", "n", "k", "--window", "5"}, l), `--window "5" is not a duration: write it as Go does, such as 500ms`},
		{cat([]string{"key", "get", "n", "k", "--window", "-1m"}, l), "the window must be positive"},
		{cat([]string{"key", "get", "n", "k", "--window", "9000h"}, l), "use a window between 1ms and"},
		{cat([]string{"key", "get", "n", "k", "--window", "1500ns"}, l), "use a window between 1ms and"},
		{cat([]string{"key", "get", "n", "k", "--burst", "-3"}, l, w), `--burst "-3"`},
		{cat([]string{"key", "get", "n", "k", "--spread", "-2"}, l, w), `--spread "-2"`},
		{cat([]string{"key", "get", "n", "k", "--algorithm", "leaky_bucket"}, l, w), "use fixed_window, token_bucket or sliding_window"},
		{cat([]string{"key", "get", "n", "k", "--key-mode", "plain"}, l, w), "--key-mode \"plain\": use hashed (the default) or readable"},
		{cat([]string{"key", "get", "n", "k", "--algorithm", "token_bucket", "--limit", "9223372036854775807"}, w), "the limiter these flags describe is not valid: ratelimit: invalid burst"},
		{cat([]string{"key", "get", "a:b", "k", "--key-mode", "readable"}, l, w), "contains ':'"},
		{cat([]string{"key", "get", strings.Repeat("n", 257), "k", "--key-mode", "readable"}, l, w), "use a name of at most 256 bytes"},
		{cat([]string{"key", "get", "n", strings.Repeat("k", 2049), "--key-mode", "readable"}, l, w), "the key has 2049 bytes, and readable keys hold at most 2048"},
		{[]string{"key", "reset", "pol", "k", "--window", "1h"}, `"pol" is a stored policy, whose shape comes from pgrl_policy: drop --window`},
		{[]string{"key", "get", "n", "k", "--output", "yaml"}, "--output must be text or json"},
	} {
		stdout, stderr, code := ks.asAppText(t, tc.args...)
		require.Equal(t, cli.ExitUsage, code, "%q: %s", tc.args, stderr)
		require.Empty(t, stdout, "%q", tc.args)
		require.Contains(t, stderr, tc.want, "%q", tc.args)
		require.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
	}
	// JSON: one object with the error and the exit code.
	out, _, code := ks.asApp(t, "key", "get", "n", "k")
	require.Equal(t, cli.ExitUsage, code)
	require.Contains(t, out["error"], "--limit N --window D")
	require.Equal(t, float64(cli.ExitUsage), out["exit_code"])

	d, err := lim.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(1), d.Used, "nothing was deleted")
}

// Without pgrl's tables the error says to run rl-migrate up (exit 1).
func TestKeyNotMigrated(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	_, stderr, code := runFn(t, db(s, "key", "get", "n", "k", "--limit", "5", "--window", "1m")...)
	require.Equal(t, cli.ExitError, code, stderr)
	require.Contains(t, stderr, "rl-migrate up")
}

// docs/KEYS.md is true: its JSON examples have exactly the fields the
// commands print, and its table names every flag.
func TestKeysDoc(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/KEYS.md")
	require.NoError(t, err)
	for _, f := range append(append([]string{}, shapeFlagNames...), "key-hex") {
		require.True(t, strings.Contains(string(doc), "| `--"+f), "docs/KEYS.md's flags table lacks --%s", f)
	}
	ks := newKeySetup(t)
	_, stderr, code := runFn(t, db(ks.schema, "set", "login", "--limit", "5", "--window", "15m")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	lim, err := policy.NewLimiter(context.Background(), ks.pool, "login", policy.Options{})
	require.NoError(t, err)
	_, err = lim.Allow(context.Background(), "ada@example.com")
	require.NoError(t, err)

	text, _, code := ks.asAppText(t, "key", "get", "login", "ada@example.com")
	require.Equal(t, cli.ExitOK, code)
	// Each line, its figures aside, begins as in the doc's example.
	digits := regexp.MustCompile(`[0-9]+`)
	normDoc := digits.ReplaceAllString(string(doc), "N")
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		line = digits.ReplaceAllString(line, "N")
		prefix := line[:min(len(line), 40)]
		require.True(t, strings.Contains(normDoc, prefix), "docs/KEYS.md's text example lacks a line like %q", line)
	}

	// get, then reset (which finds the row get saw).
	blocks := regexp.MustCompile("(?s)```json\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	require.Len(t, blocks, 2)
	for _, b := range blocks {
		var want map[string]any
		require.NoError(t, json.Unmarshal([]byte(b[1]), &want), b[1])
		cmd := strings.Fields(want["command"].(string))
		got, stderr, code := ks.asApp(t, append(cmd, "login", "ada@example.com")...)
		require.Equal(t, cli.ExitOK, code, stderr)
		require.Equal(t, fieldPaths("", want), fieldPaths("", got), "docs/KEYS.md's %s example", want["command"])
	}
}

// fieldPaths lists the fields of v's objects, nested ones as "a.b".
func fieldPaths(prefix string, v any) []string {
	m, ok := v.(map[string]any)
	if !ok {
		return nil
	}
	var out []string
	for k, sub := range m {
		out = append(out, prefix+k)
		out = append(out, fieldPaths(prefix+k+".", sub)...)
	}
	sort.Strings(out)
	return out
}
