package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// policyChildEnv, when set to a database URL, makes
// TestPolicyChildProcess the other process of TestPolicyTwoProcesses.
const policyChildEnv = "PGRL_TEST_POLICY_CHILD_URL"

// policyChildNoListenerEnv, when set, makes the child follow no
// notifications: only its checks' statements read the policies.
const policyChildNoListenerEnv = "PGRL_TEST_POLICY_CHILD_NO_LISTENER"

// policyAnswer is one check's result, as the child prints it.
type policyAnswer struct {
	Allowed bool   `json:"allowed"`
	Limit   int64  `json:"limit"`
	Used    int64  `json:"used,omitempty"`
	Error   string `json:"error,omitempty"`
}

// TestPolicyChildProcess is not a test of its own: run by
// TestPolicyTwoProcesses as a second OS process, it follows the policies
// with a Listener and answers "KEY" lines on stdin with one check each.
func TestPolicyChildProcess(t *testing.T) {
	url := os.Getenv(policyChildEnv)
	if url == "" {
		t.Skip("the other process of TestPolicyTwoProcesses")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	cache := policy.NewCache(pool)
	if os.Getenv(policyChildNoListenerEnv) == "" {
		l, err := policy.Watch(ctx, url, cache, policy.ListenerOptions{})
		require.NoError(t, err)
		defer func() { _ = l.Close() }()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, l.WaitSynced(wctx))
	}
	lim, err := policy.NewLimiter(ctx, pool, "api", policy.Options{Cache: cache, Config: ratelimit.Config{OnFailure: ratelimit.FailError}, Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: exactTimeout})})
	require.NoError(t, err)
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var a policyAnswer
		if f := strings.Fields(in.Text()); len(f) == 3 && f[0] == "BURST" {
			// BURST KEY N: N concurrent checks of KEY; Limit carries how
			// many were admitted.
			n, _ := strconv.Atoi(f[2])
			var admitted atomic.Int64
			var wg sync.WaitGroup
			for range n {
				wg.Go(func() {
					d, err := lim.Allow(ctx, f[1])
					if err != nil {
						a.Error = err.Error()
					}
					if d.Allowed {
						admitted.Add(1)
					}
				})
			}
			wg.Wait()
			a.Limit = admitted.Load()
			b, _ := json.Marshal(a)
			fmt.Println(string(b))
			continue
		}
		d, err := lim.Allow(ctx, strings.TrimSpace(in.Text()))
		if err != nil {
			a.Error = err.Error()
		}
		a.Allowed, a.Limit, a.Used = d.Allowed, d.Limit, d.Used
		b, _ := json.Marshal(a)
		fmt.Println(string(b))
	}
}

// Two OS processes share one stored policy: a change made by plain SQL in a
// third session reaches the other process within a second, an override set
// from this one applies there too, and both count in one counter.
func TestPolicyTwoProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 3, Window: time.Hour})
	require.NoError(t, err)

	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	c := startPolicyChild(t, cctx, s)
	check := func(key string) policyAnswer {
		t.Helper()
		a := c.check(t, key)
		require.Empty(t, a.Error)
		return a
	}

	require.Equal(t, policyAnswer{Allowed: true, Limit: 3, Used: 1}, check("k"))

	// A DBA's UPDATE reaches the other process within a second.
	_, err = dbtest.Admin(t).Exec(ctx, `UPDATE "`+s+`".pgrl_policy SET "limit" = 10 WHERE name = 'api'`)
	require.NoError(t, err)
	start := time.Now()
	for check("probe").Limit != 10 {
		require.Less(t, time.Since(start), time.Second, "the other process still applies the old limit")
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("the other process applied the change after %v", time.Since(start).Round(time.Millisecond))

	// Both processes count in one counter: 10 in all, whoever checks.
	mine, err := policy.NewLimiter(ctx, pool, "api", policy.Options{})
	require.NoError(t, err)
	admitted := 1 // the child's first check of "k"
	for i := range 12 {
		var allowed bool
		if i%2 == 0 {
			d, err := mine.Allow(ctx, "k")
			require.NoError(t, err)
			allowed = d.Allowed
		} else {
			allowed = check("k").Allowed
		}
		if allowed {
			admitted++
		}
	}
	require.Equal(t, 10, admitted)

	// An override set here applies there.
	p, err := policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("vip"), Limit: 50})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return check("vip").Limit == 50 }, 10*time.Second, 10*time.Millisecond)
}

// startPolicyChild starts TestPolicyChildProcess on the schema and waits
// until it has loaded its policies. env adds to its environment.
func startPolicyChild(t *testing.T, ctx context.Context, schemaName string, env ...string) *child {
	t.Helper()
	return startChild(t, ctx, "TestPolicyChildProcess", append([]string{policyChildEnv + "=" + dbtest.URLWithSchema(schemaName)}, env...)...)
}

// Four OS processes, each firing 50 concurrent checks at one key of a
// stored policy, admit exactly the policy's limit in all; on a key with an
// override, exactly the override's.
func TestPolicyMultiprocessExact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 20, Window: time.Hour})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("vip"), Limit: 35})
	require.NoError(t, err)

	cctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	children := make([]*child, 4)
	for i := range children {
		children[i] = startPolicyChild(t, cctx, s)
	}
	for _, trial := range []struct {
		key  string
		want int64
	}{{"plain", 20}, {"vip", 35}} {
		// Send every burst first, so that the four processes fire at once.
		for _, c := range children {
			c.send(t, "BURST "+trial.key+" 50")
		}
		var admitted int64
		for _, c := range children {
			var a policyAnswer
			c.read(t, &a)
			require.Empty(t, a.Error)
			admitted += a.Limit
		}
		require.Equal(t, trial.want, admitted, "key %s: 4 processes x 50 checks", trial.key)
	}
}

// check sends one check of key to a TestPolicyChildProcess and returns its
// answer.
func (c *child) check(t *testing.T, key string) policyAnswer {
	t.Helper()
	var a policyAnswer
	c.ask(t, key, &a)
	return a
}

// A change made by plain SQL is obeyed by the very next check of another
// process that listens to nothing: each check reads the policy and the
// key's override in its own statement. Lowering, raising, overriding and
// moving the window each take effect at the next check, with exact counts.
func TestPolicyNextCheckObeysPlainSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	// Day-long windows: the test does not straddle a window's end but at
	// midnight UTC.
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 5, Window: 24 * time.Hour})
	require.NoError(t, err)
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	other := startPolicyChild(t, cctx, s, policyChildNoListenerEnv+"=1")
	admin := dbtest.Admin(t)
	sql := func(q string, args ...any) {
		t.Helper()
		_, err := admin.Exec(ctx, strings.ReplaceAll(q, "$s", `"`+s+`"`), args...)
		require.NoError(t, err)
	}
	// count checks key until the first denial and returns how many were
	// admitted, with the last answer.
	count := func(key string) (int64, policyAnswer) {
		t.Helper()
		var n int64
		for range 100 {
			a := other.check(t, key)
			require.Empty(t, a.Error)
			if !a.Allowed {
				return n, a
			}
			n++
		}
		t.Fatal("never denied")
		return 0, policyAnswer{}
	}

	for range 3 {
		require.True(t, other.check(t, "k").Allowed)
	}
	sql(`UPDATE $s.pgrl_policy SET "limit" = 3 WHERE name = 'api'`)
	a := other.check(t, "k")
	require.Equal(t, policyAnswer{Allowed: false, Limit: 3, Used: 3}, a, "lowered: the next check is denied")

	sql(`UPDATE $s.pgrl_policy SET "limit" = 8 WHERE name = 'api'`)
	n, a := count("k")
	require.Equal(t, int64(5), n, "raised to 8 with 3 used: exactly 5 more")
	require.Equal(t, int64(8), a.Limit)

	sql(`INSERT INTO $s.pgrl_policy_override (policy, key, "limit") VALUES ('api', $s.pgrl_stored_key('api', 'vip'), 2)`)
	n, a = count("vip")
	require.Equal(t, int64(2), n, "an override inserted by SQL applies at the first check")
	require.Equal(t, int64(2), a.Limit)
	sql(`UPDATE $s.pgrl_policy_override SET "limit" = 4 WHERE policy = 'api'`)
	n, _ = count("vip")
	require.Equal(t, int64(2), n, "override raised from 2 to 4: exactly 2 more")

	// A new window moves the key's counter: the child's statement finds
	// its row moved, reloads the policy, and checks at the new window.
	sql(`UPDATE $s.pgrl_policy SET "window" = interval '2 days', "limit" = 6 WHERE name = 'api'`)
	n, a = count("k")
	require.Equal(t, int64(6), n, "a fresh 2-day window of 6")
	require.Equal(t, int64(6), a.Limit)

	sql(`DELETE FROM $s.pgrl_policy WHERE name = 'api'`)
	a = other.check(t, "k")
	require.Contains(t, a.Error, "does not exist", "a deleted policy is an error, not a default")
}
