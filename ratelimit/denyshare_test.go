package ratelimit_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/denywire"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// hourlyShared is a token bucket of one unit per hour that shares its
// denials: once spent, a key is denied for about an hour.
// Its checks wait for PostgreSQL as long as the tests look (testkit.DecisionTimeout):
// they assert which store answered, and a loaded machine answers late.
var hourlyShared = ratelimit.Config{Name: "signup", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Hour, ShareDenials: true}

// hourlySharedDB is the DatabaseOptions of hourlyShared's limiters.
var hourlySharedDB = ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}

// listenDenials opens a connection of its own on schema s that LISTENs on
// DenyChannel.
func listenDenials(t *testing.T, s string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbtest.URLWithSchema(s))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN "+ratelimit.DenyChannel)
	require.NoError(t, err)
	return conn
}

// notifications collects the readable payloads of schema s that arrive on
// conn within wait (other tests notify on the same channel of the
// database).
func notifications(t *testing.T, conn *pgx.Conn, s string, wait time.Duration) []string {
	t.Helper()
	var out []string
	deadline := time.Now().Add(wait)
	for {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		n, err := conn.WaitForNotification(ctx)
		cancel()
		if err != nil {
			require.False(t, conn.IsClosed(), "listening connection lost: %v", err)
			return out
		}
		if p, _, err := denywire.Decode(n.Payload); err != nil || p.Schema != s {
			// Another test's: its limiters, or the hostile payloads of
			// package policy's tests, notify on the same channel. A bad
			// payload of this test's limiter is missed here and fails the
			// counts.
			continue
		}
		out = append(out, n.Payload)
	}
}

// Configurations that cannot share are refused with errors naming the fix;
// a penalised limit (whose deny cache is off) is accepted and sends nothing.
func TestShareDenialsConfigErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	for _, c := range []struct {
		edit func(*ratelimit.Config)
		err  error
		fix  string
	}{
		{func(c *ratelimit.Config) { c.Spread = 2; c.Limit = 2 }, ratelimit.ErrInvalidOption, "use Spread 1"},
		{func(c *ratelimit.Config) { c.KeyMode = ratelimit.ReadableKeys }, ratelimit.ErrInvalidOption, "use HashedKeys"},
		{func(c *ratelimit.Config) { c.DenyCacheSize = -1 }, ratelimit.ErrInvalidOption, "set DenyCacheSize"},
	} {
		cfg := hourlyShared
		c.edit(&cfg)
		_, err := testkit.New(pool, cfg, hourlySharedDB)
		require.ErrorIs(t, err, c.err)
		require.ErrorContains(t, err, c.fix)
	}
	conn, err := pgx.Connect(ctx, dbtest.URLWithSchema(s))
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	_, err = testkit.New(conn, hourlyShared, hourlySharedDB)
	require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
	require.ErrorContains(t, err, "*pgxpool.Pool")

	listen := listenDenials(t, s)
	cfg := hourlyShared
	cfg.Penalty = true
	pen, err := testkit.New(pool, cfg, hourlySharedDB)
	require.NoError(t, err)
	for range 3 {
		_, err := pen.Allow(ctx, "k")
		require.NoError(t, err)
	}
	require.Empty(t, notifications(t, listen, s, 200*time.Millisecond))
	require.Zero(t, pen.ShareStats().Sent)
}

// The Database's options govern sharing: with a pinned clock
// (DatabaseOptions.Now) a limit sends no denial and takes no mark (the
// deadlines would not be on the database's clock), and a denial shorter
// than the Database's ShareMinRetryAfter is not sent.
func TestShareDenialsFollowTheDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	listen := listenDenials(t, s)
	pinnedDB := hourlySharedDB
	pinnedDB.Now = testkit.Pinned(time.Now())
	pinnedCfg := hourlyShared
	pinnedCfg.Name = "signup-pinned"
	pinned, err := testkit.New(pool, pinnedCfg, pinnedDB)
	require.NoError(t, err)
	longDB := hourlySharedDB
	longDB.ShareMinRetryAfter = 2 * time.Hour // above the hourly bucket's longest denial
	longCfg := hourlyShared
	longCfg.Name = "signup-long"
	long, err := testkit.New(pool, longCfg, longDB)
	require.NoError(t, err)
	for _, l := range []*ratelimit.Limiter{pinned, long} {
		for i := range 2 {
			d, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, i == 0, d.Allowed)
			require.Equal(t, ratelimit.StorePostgres, d.Store)
		}
	}
	require.Empty(t, notifications(t, listen, s, 200*time.Millisecond))
	require.Zero(t, pinned.ShareStats().Sent)
	require.Zero(t, long.ShareStats().Sent)
	mark := ratelimit.SharedDenial{Algorithm: ratelimit.TokenBucket, Rate: ratelimit.Rate{Limit: 1, Window: time.Hour},
		Cost: 1, Used: 1, Until: time.Now().Add(time.Minute)}
	mark.Key = ratelimit.StoredKey(ratelimit.HashedKeys, pinnedCfg.Name, "other")
	require.False(t, pinned.AddDenial(mark), "a limit on a pinned clock takes no mark")
	mark.Key = ratelimit.StoredKey(ratelimit.HashedKeys, longCfg.Name, "other")
	require.True(t, long.AddDenial(mark), "on the database's clock it does")
}

// A key's denial is sent once per deadline, however often PostgreSQL
// denies it again; the payload names the schema, carries the stored key
// (never the caller's), and PostgreSQL's deadline on its own clock. A
// denial shorter than DatabaseOptions.ShareMinRetryAfter is not sent.
func TestShareDenialsOncePerDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	listen := listenDenials(t, s)
	l, err := testkit.New(pool, hourlyShared, hourlySharedDB)
	require.NoError(t, err)
	const key = "ada@example.com"
	d, err := l.Allow(ctx, key)
	require.NoError(t, err)
	require.True(t, d.Allowed)
	var first ratelimit.Decision
	for i := range 20 {
		ratelimit.ForgetLocalDenial(l, key) // the next check asks PostgreSQL
		d, err := l.Allow(ctx, key)
		require.NoError(t, err)
		require.False(t, d.Allowed)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		if i == 0 {
			first = d
		}
	}
	// The sender works in the background: wait for its statement to
	// return (on a busy machine it may have to open a connection first),
	// then for whatever else might still come.
	require.Eventually(t, func() bool {
		st := l.ShareStats()
		return st.Notifies+st.Failed > 0
	}, 10*time.Second, 5*time.Millisecond)
	got := notifications(t, listen, s, time.Second)
	require.Equal(t, 1, len(got), "one notification for one key and deadline")
	require.NotContains(t, got[0], key)
	require.NotContains(t, got[0], hex.EncodeToString([]byte(key)))
	p, marks, err := denywire.Decode(got[0])
	require.NoError(t, err)
	require.Equal(t, s, p.Schema)
	require.Equal(t, "signup", p.Limiter)
	require.Equal(t, "token_bucket", p.Algorithm)
	require.Equal(t, int64(time.Hour/time.Microsecond), p.WindowUs)
	require.Len(t, marks, 1)
	require.Equal(t, ratelimit.StoredKey(ratelimit.HashedKeys, "signup", key), marks[0].Key)
	require.Equal(t, int64(1), marks[0].Cost)
	require.Equal(t, first.Now.Add(first.RetryAfter).UnixMicro(), marks[0].UntilUs)
	st := l.ShareStats()
	require.Equal(t, ratelimit.ShareStats{Sent: 1, Notifies: 1}, st)

	fast, err := testkit.New(pool, ratelimit.Config{Name: "fast", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: 100 * time.Millisecond, ShareDenials: true})
	require.NoError(t, err)
	denied := 0
	for range 20 {
		d, err := fast.Allow(ctx, "k")
		require.NoError(t, err)
		if !d.Allowed {
			denied++
		}
	}
	require.Positive(t, denied)
	require.Empty(t, notifications(t, listen, s, 200*time.Millisecond))
	require.Zero(t, fast.ShareStats().Sent)
}

// One client hammering many keys cannot flood the notification queue: a
// limiter sends one statement at a time, at most one per 20ms, marks that
// do not fit its queue are dropped and counted, every payload fits in a
// NOTIFY, and every mark is either sent or counted.
func TestShareDenialsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	listen := listenDenials(t, s)
	l, err := testkit.New(pool, hourlyShared, hourlySharedDB)
	require.NoError(t, err)
	const keys = 3000
	var wg sync.WaitGroup
	start := time.Now()
	for w := range 16 {
		wg.Go(func() {
			for i := w; i < keys; i += 16 {
				k := fmt.Sprintf("client-%d", i)
				for range 2 {
					_, err := l.Allow(ctx, k)
					require.NoError(t, err)
				}
			}
		})
	}
	wg.Wait()
	require.Eventually(t, func() bool {
		st := l.ShareStats()
		return st.Sent+st.Dropped+st.Failed == keys
	}, 10*time.Second, 10*time.Millisecond, "%+v", l.ShareStats())
	elapsed := time.Since(start)
	st := l.ShareStats()
	require.Zero(t, st.Failed)
	require.LessOrEqual(t, st.Notifies, uint64(elapsed/(20*time.Millisecond))+2, "at most one statement per 20ms")
	// Every mark sent arrives, in payloads PostgreSQL accepted.
	var got []string
	marks := 0
	for wait := time.Now().Add(10 * time.Second); marks < int(st.Sent) && time.Now().Before(wait); {
		for _, p := range notifications(t, listen, s, 100*time.Millisecond) {
			require.Less(t, len(p), 8000)
			require.True(t, strings.HasPrefix(p, "{"))
			_, m, err := denywire.Decode(p)
			require.NoError(t, err)
			marks += len(m)
			got = append(got, p)
		}
	}
	t.Logf("%d denials in %v: %+v, %d notifications", keys, elapsed.Round(time.Millisecond), st, len(got))
	require.Equal(t, int(st.Sent), marks)
}
