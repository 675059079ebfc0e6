package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// base is a fixed instant on a minute boundary, for pinned-clock tests.
var base = time.Date(2030, 1, 2, 3, 4, 0, 0, time.UTC)

func TestBadInputs(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ok := ratelimit.Config{Name: "x", Limit: 5, Window: time.Minute}
	cases := []struct {
		name string
		db   ratelimit.DB
		cfg  func(c ratelimit.Config) ratelimit.Config
		want error
	}{
		{"nil db", nil, func(c ratelimit.Config) ratelimit.Config { return c }, ratelimit.ErrNilDB},
		{"empty name", pool, func(c ratelimit.Config) ratelimit.Config { c.Name = ""; return c }, ratelimit.ErrInvalidName},
		{"readable name with colon", pool, func(c ratelimit.Config) ratelimit.Config {
			c.Name, c.KeyMode = "a:b", ratelimit.ReadableKeys
			return c
		}, ratelimit.ErrInvalidName},
		{"zero limit", pool, func(c ratelimit.Config) ratelimit.Config { c.Limit = 0; return c }, ratelimit.ErrInvalidLimit},
		{"negative limit", pool, func(c ratelimit.Config) ratelimit.Config { c.Limit = -1; return c }, ratelimit.ErrInvalidLimit},
		{"zero window", pool, func(c ratelimit.Config) ratelimit.Config { c.Window = 0; return c }, ratelimit.ErrInvalidWindow},
		{"negative window", pool, func(c ratelimit.Config) ratelimit.Config { c.Window = -time.Second; return c }, ratelimit.ErrInvalidWindow},
		{"tiny window", pool, func(c ratelimit.Config) ratelimit.Config { c.Window = time.Microsecond; return c }, ratelimit.ErrInvalidWindow},
		{"negative burst", pool, func(c ratelimit.Config) ratelimit.Config {
			c.Algorithm, c.Burst = ratelimit.TokenBucket, -1
			return c
		}, ratelimit.ErrInvalidBurst},
		{"unknown algorithm", pool, func(c ratelimit.Config) ratelimit.Config { c.Algorithm = "leaky"; return c }, ratelimit.ErrInvalidAlgorithm},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := testkit.New(tc.db, tc.cfg(ok))
			require.ErrorIs(t, err, tc.want)
			if tc.want == ratelimit.ErrNilDB {
				return
			}
			require.NotEmpty(t, strings.TrimPrefix(err.Error(), tc.want.Error()), "the message adds detail")
		})
	}

	var nilPool *pgx.Conn
	_, err := testkit.New(nilPool, ok)
	require.ErrorIs(t, err, ratelimit.ErrNilDB)

	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "bad-" + string(alg), Algorithm: alg, Limit: 5, Window: time.Minute})
		_, err := l.Allow(ctx, "k", ratelimit.Cost(0))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
		_, err = l.Allow(ctx, "k", ratelimit.Cost(-3))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
		_, err = l.Allow(ctx, "k", ratelimit.Cost(6))
		require.ErrorIs(t, err, ratelimit.ErrCostExceedsLimit)
		// Nothing was written by the refused calls.
		var n int
		require.NoError(t, pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM pgrl_fixed_window) + (SELECT count(*) FROM pgrl_token_bucket) + (SELECT count(*) FROM pgrl_sliding_window)").Scan(&n))
		require.Zero(t, n)
	}
}

func TestNotMigrated(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t) // empty: no migrations
	pool := dbtest.PoolOn(t, s)
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "nm", Algorithm: alg, Limit: 5, Window: time.Minute})
		_, err := l.Allow(context.Background(), "k")
		require.ErrorIs(t, err, ratelimit.ErrNotMigrated)
		require.Contains(t, err.Error(), "rl-migrate up")
		_, err = l.Peek(context.Background(), "k")
		require.ErrorIs(t, err, ratelimit.ErrNotMigrated)
	}
}

func TestAnyBytesAreAKeyAndNoRawKeyIsStored(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	big := strings.Repeat("x", 1<<20) + "needle-1mb"
	keys := []string{"", "\x00", "a\x00b", "\xff\xfe\xfd", "user@example.com", "203.0.113.7", big}
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "keys", Algorithm: alg, Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
		for _, k := range keys {
			for i := range 3 {
				d, err := l.Allow(ctx, k)
				require.NoError(t, err)
				require.Equal(t, i < 2, d.Allowed, "%s key %q check %d", alg, k[:min(len(k), 10)], i)
			}
		}
	}
	for _, table := range []string{"pgrl_fixed_window", "pgrl_token_bucket", "pgrl_sliding_window"} {
		var n, distinctLen int
		require.NoError(t, pool.QueryRow(ctx, fmt.Sprintf("SELECT count(*), count(DISTINCT octet_length(key)) FROM %s", table)).Scan(&n, &distinctLen))
		require.Equal(t, len(keys), n, table)
		require.Equal(t, 1, distinctLen, "%s: every stored key has the digest's fixed size", table)
		for _, raw := range []string{"user@example.com", "203.0.113.7", "needle-1mb"} {
			var found bool
			require.NoError(t, pool.QueryRow(ctx, fmt.Sprintf("SELECT EXISTS (SELECT 1 FROM %s WHERE position($1::bytea in key) > 0)", table), []byte(raw)).Scan(&found))
			require.False(t, found, "%s holds the raw key %q", table, raw)
		}
	}

	// The documented opt-out keeps readable keys.
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "readable", Limit: 2, Window: time.Minute, KeyMode: ratelimit.ReadableKeys})
	_, err := l.Allow(ctx, "user@example.com")
	require.NoError(t, err)
	var found bool
	require.NoError(t, pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pgrl_fixed_window WHERE key = $1)", []byte("readable:user@example.com")).Scan(&found))
	require.True(t, found)
}

func TestTxRollbackRefunds(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tx", Algorithm: alg, Limit: 2, Window: time.Hour}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		d, err := l.AllowTx(ctx, tx, "k", ratelimit.Cost(2))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.NoError(t, tx.Rollback(ctx))

		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(2), p.Remaining, "%s: rollback refunds", alg)

		tx, err = pool.Begin(ctx)
		require.NoError(t, err)
		_, err = l.AllowTx(ctx, tx, "k", ratelimit.Cost(2))
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
		p, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(0), p.Remaining, "%s: commit keeps", alg)
	}
}

// TestTxChecksAreObserved checks that a check inside the caller's
// transaction reaches the Observer like any other, and that Peek, which
// counts nothing, does not.
func TestTxChecksAreObserved(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	obs := &testkit.Observer{}
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tx-observed", Limit: 1, Window: time.Hour}, ratelimit.DatabaseOptions{Observer: obs, Now: testkit.Pinned(base)})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = l.AllowTx(ctx, tx, "k")
	require.NoError(t, err)
	_, err = l.AllowTx(ctx, tx, "k")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	_, err = l.Peek(ctx, "k")
	require.NoError(t, err)

	seen := obs.Decisions()
	require.Len(t, seen, 2, "two checks in a transaction, one Peek")
	require.True(t, seen[0].Allowed)
	require.False(t, seen[1].Allowed)
	require.Equal(t, ratelimit.StorePostgres, seen[1].Store)
}

// TestElapsedClampedAtZero replays a check whose clock is older than the
// row's last update, as happens to a statement that waited on the row lock.
func TestElapsedClampedAtZero(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base.Add(10 * time.Second))
	tb := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "clamp", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Second, Burst: 3}, ratelimit.DatabaseOptions{Now: c.Now})
	_, err := tb.Allow(ctx, "k", ratelimit.Cost(3))
	require.NoError(t, err)
	c.Set(base.Add(8 * time.Second)) // older than the row
	d, err := tb.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed, "no negative refill, no refill at all")
	require.Equal(t, base.Add(10*time.Second), d.Now.UTC(), "the decision keeps the newer instant")
	c.Set(base.Add(11 * time.Second))
	d, err = tb.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed, "one second after the newer instant, one token")
	require.Equal(t, int64(0), d.Remaining)

	sw := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "clamp", Algorithm: ratelimit.SlidingWindow, Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	c.Set(base.Add(time.Minute))
	_, err = sw.Allow(ctx, "k", ratelimit.Cost(2))
	require.NoError(t, err)
	c.Set(base.Add(59 * time.Second)) // the previous window, after the row rolled forward
	d, err = sw.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed, "an older clock counts against the newer window")
}

func TestRetryAfterSeconds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   time.Duration
		want int64
	}{{0, 0}, {-time.Second, 0}, {time.Nanosecond, 1}, {999 * time.Millisecond, 1}, {time.Second, 1}, {1001 * time.Millisecond, 2}, {90 * time.Second, 90}} {
		d := ratelimit.Decision{RetryAfter: tc.in}
		require.Equal(t, tc.want, d.RetryAfterSeconds(), tc.in.String())
		require.Equal(t, fmt.Sprint(tc.want), d.RetryAfterHeader())
	}
	d := ratelimit.Decision{Now: base, ResetAt: base.Add(-time.Second)}
	require.Zero(t, d.ResetAfter())
}

var _ = errors.Is
var _ = math.Abs
var _ = rand.IntN

func TestOpportunisticCleanup(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	// Rows of windows long past, as if no cleanup had run for a while.
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT decode(lpad(to_hex(g), 32, '0'), 'hex'), now() - interval '1 hour', 1, true FROM generate_series(1, 500) AS g`)
	require.NoError(t, err)
	logs := &testkit.LogBuffer{}
	oc := &cleanup.Opportunistic{Every: 1, Logger: slog.New(slog.NewTextHandler(logs, nil))}
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "oc", Limit: 10, Window: time.Minute}, ratelimit.DatabaseOptions{Cleanup: oc})
	for range 3 {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
	}
	oc.Wait()
	require.Positive(t, oc.Started())
	// Dead: the rows that had expired when the test began. A row of "k"
	// whose window ends while the test runs may be kept a while longer:
	// cleanup keeps what an open transaction of the database (another
	// test's) could still read.
	var dead, live int
	count := func() {
		require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE expires_at <= now() - interval '30 minutes'), count(*) FILTER (WHERE expires_at > now()) FROM pgrl_fixed_window").Scan(&dead, &live))
	}
	count()
	// A background cleanup may be skipped (another cleanup of the
	// database holds its lock: the suite runs others beside this test) or
	// time out on a loaded machine; the next checks start another.
	for deadline := time.Now().Add(30 * time.Second); dead > 0 && time.Now().Before(deadline); count() {
		_, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		oc.Wait()
	}
	require.Zero(t, dead, "expired rows deleted from the request path; cleanup log:\n%s", logs.String())
	require.Equal(t, 1, live, "the live counter is kept")
}
