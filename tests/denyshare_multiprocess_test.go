package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// denyChildEnv, when set to a database URL, makes TestDenyShareChildProcess
// process B of TestDenyShareTwoProcesses.
const denyChildEnv = "PGRL_TEST_DENY_CHILD_URL"

// denyShared is the limit both processes check: one unit per hour, so a
// spent key is denied for about an hour.
// Its checks wait for PostgreSQL as long as the tests look: they assert
// which store answered.
var denyShared = ratelimit.Config{Name: "signup:email", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Hour}

// denySharedDB is the DatabaseOptions of denyShared's limiters.
var denySharedDB = ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}

// denyReport is process B's answer to one command.
type denyReport struct {
	Received   uint64 `json:"received"`     // marks its limiter took
	Checks     int    `json:"checks"`       // checks made
	FromCache  int    `json:"from_cache"`   // denied with Store deny_cache
	Statements int64  `json:"statements"`   // statements its limiter sent meanwhile
	MaxRetryUs int64  `json:"max_retry_us"` // longest RetryAfter answered
	Error      string `json:"error,omitempty"`
}

// TestDenyShareChildProcess is not a test of its own: run by
// TestDenyShareTwoProcesses as process B, it receives shared denials with
// a Listener and answers commands on stdin: "WAIT N" waits until its
// limiter holds N received marks, "CHECK KEY N" checks KEY N times.
func TestDenyShareChildProcess(t *testing.T) {
	url := os.Getenv(denyChildEnv)
	if url == "" {
		t.Skip("process B of TestDenyShareTwoProcesses")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	db := &testkit.CountingDB{Pool: pool}
	lim, err := testkit.New(db, denyShared, denySharedDB)
	require.NoError(t, err)
	l, err := policy.Watch(ctx, url, policy.NewCache(pool), policy.ListenerOptions{Denials: true})
	require.NoError(t, err)
	defer func() { _ = l.Close() }()
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	require.NoError(t, l.Register(lim))
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var r denyReport
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 2 && f[0] == "WAIT":
			n, _ := strconv.ParseUint(f[1], 10, 64)
			deadline := time.Now().Add(10 * time.Second)
			for lim.ShareStats().Received < n && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
		case len(f) == 3 && f[0] == "CHECK":
			n, _ := strconv.Atoi(f[2])
			before := db.Statements()
			for range n {
				d, err := lim.Allow(ctx, f[1])
				if err != nil {
					r.Error = err.Error()
					break
				}
				r.Checks++
				if !d.Allowed && d.Store == ratelimit.StoreDenyCache {
					r.FromCache++
				}
				r.MaxRetryUs = max(r.MaxRetryUs, d.RetryAfter.Microseconds())
			}
			r.Statements = db.Statements() - before
		}
		r.Received = lim.ShareStats().Received
		b, _ := json.Marshal(r)
		fmt.Println(string(b))
	}
}

// The acceptance test of shared denials: process A (this one) drives a key
// into denial; process B, once its listener has handed it the mark, checks
// that key 500 times and every check is denied from its deny cache with
// no statement sent to the database, and never for longer than PostgreSQL
// said. A key B has no mark for still reaches the database.
func TestDenyShareTwoProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)

	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	b := startChild(t, cctx, "TestDenyShareChildProcess", denyChildEnv+"="+dbtest.URLWithSchema(s))
	ask := func(line string) denyReport {
		t.Helper()
		var r denyReport
		b.ask(t, line, &r)
		require.Empty(t, r.Error)
		return r
	}

	cfg := denyShared
	cfg.ShareDenials = true
	a, err := testkit.New(pool, cfg, denySharedDB)
	require.NoError(t, err)
	const key = "ada@example.com"
	d, err := a.Allow(ctx, key)
	require.NoError(t, err)
	require.True(t, d.Allowed)
	sent := time.Now()
	d, err = a.Allow(ctx, key)
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store)

	r := ask("WAIT 1")
	require.Equal(t, uint64(1), r.Received, "process B did not receive the mark")
	t.Logf("process B held the mark %v after process A's denial", time.Since(sent).Round(time.Millisecond))

	r = ask("CHECK " + key + " 500")
	require.Equal(t, 500, r.Checks)
	require.Equal(t, 500, r.FromCache, "every check of the key is answered from B's deny cache")
	require.Zero(t, r.Statements, "process B sent no statement for the key")
	require.Less(t, time.Duration(r.MaxRetryUs)*time.Microsecond, d.RetryAfter, "B denies no longer than PostgreSQL")

	r = ask("CHECK grace@example.com 1")
	require.Zero(t, r.FromCache)
	require.Positive(t, r.Statements, "a key without a mark is asked of PostgreSQL")
	// A counts a mark as sent once its NOTIFY statement has returned,
	// which may be after B has received it: wait for that.
	require.True(t, settleWithin(30*time.Second, func() bool { return a.ShareStats().Sent >= 1 }), "A counts the mark it sent")
	require.Equal(t, uint64(1), a.ShareStats().Sent)
}
