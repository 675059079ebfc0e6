package policy_test

import (
	"context"
	"encoding/hex"
	"fmt"
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

// watchDenials starts a listener with Denials on schema s and waits for it.
func watchDenials(t *testing.T, pool *pgxpool.Pool, s string) *policy.Listener {
	t.Helper()
	return watchDenialsInto(t, policy.NewCache(pool), s)
}

// watchDenialsInto is watchDenials keeping cache current.
func watchDenialsInto(t *testing.T, cache *policy.Cache, s string) *policy.Listener {
	t.Helper()
	ctx := context.Background()
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{
		Denials: true, MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, l.WaitSynced(wctx))
	return l
}

// hourly is a token bucket of one unit per hour: once spent, a check is
// denied for about an hour, whatever the instant.
// Its checks wait for PostgreSQL as long as the tests look: they assert
// which store answered.
var hourly = ratelimit.Config{Name: "signup", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Hour}

// hourlyDB is the DatabaseOptions of hourly's limiters.
var hourlyDB = ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}

// sharer is the limiter that learns a denial from PostgreSQL and shares it.
func sharer(t *testing.T, pool *pgxpool.Pool, cfg ratelimit.Config) *ratelimit.Limiter {
	t.Helper()
	cfg.ShareDenials = true
	l, err := testkit.New(pool, cfg, hourlyDB)
	require.NoError(t, err)
	return l
}

// deny spends key's unit and checks it once more: PostgreSQL denies.
func deny(t *testing.T, l interface {
	Allow(context.Context, string, ...ratelimit.Option) (ratelimit.Decision, error)
}, key string) ratelimit.Decision {
	t.Helper()
	ctx := context.Background()
	d, err := l.Allow(ctx, key)
	require.NoError(t, err)
	require.True(t, d.Allowed)
	d, err = l.Allow(ctx, key)
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	return d
}

// A denial learnt by one limiter reaches another limiter of the same name
// on another pool through the listener, for a plain ratelimit.Limiter and
// for a policy.Limiter: the receiver then answers every check of the key
// from its deny cache, with no statement, never past PostgreSQL's
// deadline; other keys and smaller costs still go to PostgreSQL.
func TestSharedDenialReachesOtherLimiter(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"ratelimit", "policy"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			poolA, s := dbtest.Pool(t)
			poolB := dbtest.PoolOn(t, s)
			_, err := policy.Set(ctx, poolA, policy.Policy{Name: hourly.Name, Algorithm: hourly.Algorithm, Limit: 1, Window: time.Hour})
			require.NoError(t, err)
			cacheB := policy.NewCache(poolB)
			listener := watchDenialsInto(t, cacheB, s)
			cdb := &testkit.CountingDB{Pool: poolB}

			var a, b interface {
				Allow(context.Context, string, ...ratelimit.Option) (ratelimit.Decision, error)
				ShareStats() ratelimit.ShareStats
			}
			var recv policy.DenialReceiver
			if kind == "ratelimit" {
				a = sharer(t, poolA, hourly)
				rb, err := testkit.New(cdb, hourly, hourlyDB)
				require.NoError(t, err)
				b, recv = rb, rb
			} else {
				pa, err := newLimiter(ctx, poolA, hourly.Name, policy.Options{Config: ratelimit.Config{ShareDenials: true}})
				require.NoError(t, err)
				pb, err := newLimiter(ctx, cdb, hourly.Name, policy.Options{Cache: cacheB})
				require.NoError(t, err)
				a, b, recv = pa, pb, pb
			}
			require.NoError(t, listener.Register(recv))

			dA := deny(t, a, "203.0.113.7")
			require.Eventually(t, func() bool { return listener.Stats().Denials.Applied >= 1 }, 5*time.Second, 2*time.Millisecond)
			// The statement's result may come back after the listener has
			// the notification.
			require.Eventually(t, func() bool { return a.ShareStats().Sent == 1 }, 5*time.Second, 2*time.Millisecond)

			before := cdb.Statements()
			for range 200 {
				d, err := b.Allow(ctx, "203.0.113.7")
				require.NoError(t, err)
				require.False(t, d.Allowed)
				require.Equal(t, ratelimit.StoreDenyCache, d.Store)
				require.Positive(t, d.RetryAfter)
				require.Less(t, d.RetryAfter, dA.RetryAfter, "the receiver denies no longer than PostgreSQL")
				require.Equal(t, int64(1), d.Limit)
			}
			require.Equal(t, before, cdb.Statements(), "no statement for a key another process learnt is denied")
			require.Equal(t, uint64(200), b.ShareStats().Answered)

			// Another key is still asked of PostgreSQL.
			d, err := b.Allow(ctx, "198.51.100.1")
			require.NoError(t, err)
			require.True(t, d.Allowed)
			require.Equal(t, ratelimit.StorePostgres, d.Store)
			require.Greater(t, cdb.Statements(), before)

			st := listener.Stats().Denials
			require.Equal(t, uint64(1), st.Received)
			// (OtherSchema counts the marks of tests running beside this one,
			// Invalid the unreadable payloads of the hostile-payload test.)
			require.Zero(t, st.Refused+st.Unknown+st.Dropped)
		})
	}
}

// dbMicros is the database's clock in microseconds since the epoch.
func dbMicros(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var us int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint`).Scan(&us))
	return us
}

// Hostile and stale payloads on the channel (any role of the database may
// NOTIFY) are counted and ignored, and never panic: unreadable ones, marks
// of another schema or of an unknown limiter, expired deadlines, deadlines
// beyond anything PostgreSQL could decide, another rate or algorithm, bad
// keys and costs. A well-formed mark sent by hand is applied.
func TestSharedDenialHostilePayloads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	listener := watchDenials(t, pool, s)
	cdb := &testkit.CountingDB{Pool: pool}
	b, err := testkit.New(cdb, hourly, hourlyDB)
	require.NoError(t, err)
	require.NoError(t, listener.Register(b))
	key := hex.EncodeToString(ratelimit.StoredKey(ratelimit.HashedKeys, hourly.Name, "victim"))
	now := dbMicros(t, pool)
	later := now + int64(30*time.Minute/time.Microsecond)
	payload := func(schema, limiter, alg string, windowUs, limit, burst int64, mark string) string {
		return fmt.Sprintf(`{"v":1,"schema":%q,"limiter":%q,"alg":%q,"window_us":%d,"limit":%d,"burst":%d,"marks":[%s]}`,
			schema, limiter, alg, windowUs, limit, burst, mark)
	}
	mark := func(key string, cost, until int64) string {
		return fmt.Sprintf(`{"key":%q,"cost":%d,"until_us":%d,"reset_us":%d,"used":1}`, key, cost, until, until)
	}
	hour := int64(time.Hour / time.Microsecond)
	good := mark(key, 1, later)
	invalid := []string{
		``, `{`, `null`, `[]`, `"x"`, `{"v":2}`, strings.Repeat("x", 7990),
		`{"v":1,"schema":"` + s + `","limiter":"signup","alg":"token_bucket","window_us":1e400,"limit":1,"burst":1,"marks":[` + good + `]}`,
		`{"v":1,"schema":"` + s + `","limiter":"signup","alg":"token_bucket","window_us":3600000000,"limit":99999999999999999999,"burst":1,"marks":[` + good + `]}`,
		payload(s, "signup", "token_bucket", -hour, 1, 1, good),
		payload(s, "signup", "token_bucket", hour, 0, 1, good),
		payload(s, "signup", "token_bucket", hour, 1, 1, ""),
		payload(s, "signup", "token_bucket", hour, 1, 1, mark("zz", 1, later)),
		payload(s, "signup", "token_bucket", hour, 1, 1, mark("", 1, later)),
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, -1, later)),
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, 1, -later)),
		payload(s, "signup", "token_bucket", hour, 1, 1, `{"key":"`+key+`","cost":1,"until_us":9223372036854775808}`),
		payload(s, "signup", "token_bucket", hour, 1, 1, `{"key":1}`),
	}
	refused := []string{
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, 1, now-1000)),                     // expired
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, 1, 9223372036854775807)),          // beyond any denial
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, 1, now+3*hour)),                   // beyond this rate's longest
		payload(s, "signup", "token_bucket", hour, 2, 2, good),                                       // another rate
		payload(s, "signup", "fixed_window", hour, 1, 1, good),                                       // another algorithm
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key, 2, later)),                        // cost beyond the limit
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(key+"00", 1, later)),                   // not a hashed key
		payload(s, "signup", "token_bucket", hour, 1, 1, mark(strings.Repeat("ab", 3000), 1, later)), // huge key
	}
	otherSchema := payload(s+"_other", "signup", "token_bucket", hour, 1, 1, good)
	unknown := payload(s, "nobody", "token_bucket", hour, 1, 1, good)

	notify := func(p string) {
		t.Helper()
		_, err := pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ratelimit.DenyChannel, p)
		require.NoError(t, err)
	}
	for _, p := range append(append(append(invalid, refused...), otherSchema), unknown) {
		notify(p)
	}
	want := policy.DenialStats{
		Received: uint64(len(refused) + 1), Refused: uint64(len(refused)), Unknown: 1,
		OtherSchema: 1, Invalid: uint64(len(invalid)),
	}
	// Tests running beside this one notify on the same channel, in other
	// schemas: OtherSchema counts at least this test's one.
	got := func() policy.DenialStats {
		st := listener.Stats().Denials
		if st.OtherSchema >= 1 {
			st.OtherSchema = 1
		}
		return st
	}
	require.Eventually(t, func() bool { return got() == want }, 5*time.Second, 5*time.Millisecond,
		"got %+v, want %+v", listener.Stats().Denials, want)
	d, err := b.Allow(ctx, "victim")
	require.NoError(t, err)
	require.True(t, d.Allowed, "nothing was applied")
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, uint64(len(refused)), b.ShareStats().Refused)

	// The same mark, well formed, is applied: the receiver denies a key
	// PostgreSQL would still admit here, since the mark says so (which is
	// why the channel is for trusted roles only; see docs/POLICIES.md).
	notify(payload(s, "signup", "token_bucket", hour, 1, 1, mark(hex.EncodeToString(ratelimit.StoredKey(ratelimit.HashedKeys, hourly.Name, "other")), 1, later)))
	require.Eventually(t, func() bool { return listener.Stats().Denials.Applied == 1 }, 5*time.Second, 5*time.Millisecond)
	n := cdb.Statements()
	d, err = b.Allow(ctx, "other")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreDenyCache, d.Store)
	require.Equal(t, n, cdb.Statements())
	require.LessOrEqual(t, d.RetryAfter, 30*time.Minute)
	require.Greater(t, d.RetryAfter, 29*time.Minute)
	require.True(t, listener.Stats().Connected, "no payload cost the connection")
	require.Zero(t, listener.Stats().Reconnects)
}

// A listener whose connection is terminated reconnects and still receives
// marks; Register needs Denials; a listener turned off changes nothing.
func TestSharedDenialListenerReconnects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	plain, err := policy.Watch(ctx, dbtest.URLWithSchema(s), policy.NewCache(pool), policy.ListenerOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = plain.Close() })
	listener := watchDenials(t, pool, s)
	a := sharer(t, pool, hourly)
	cdb := &testkit.CountingDB{Pool: pool}
	b, err := testkit.New(cdb, hourly, hourlyDB)
	require.NoError(t, err)
	require.ErrorContains(t, plain.Register(b), "ListenerOptions{Denials: true}")
	require.Error(t, listener.Register(nil))
	require.NoError(t, listener.Register(b))

	pid := listener.PID()
	require.NotZero(t, pid)
	var killed bool
	require.NoError(t, dbtest.Admin(t).QueryRow(ctx, `SELECT pg_terminate_backend($1)`, int32(pid)).Scan(&killed))
	require.True(t, killed)
	require.Eventually(t, func() bool {
		st := listener.Stats()
		return st.Reconnects >= 1 && st.Connected && listener.PID() != pid
	}, 10*time.Second, 10*time.Millisecond)

	deny(t, a, "after-restart")
	require.Eventually(t, func() bool { return b.ShareStats().Received == 1 }, 5*time.Second, 2*time.Millisecond)
	d, err := b.Allow(ctx, "after-restart")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreDenyCache, d.Store)

	// Turned off: later denials are not received.
	require.NoError(t, listener.Close())
	deny(t, a, "after-close")
	require.Eventually(t, func() bool { return a.ShareStats().Sent == 2 }, 5*time.Second, 2*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, uint64(1), b.ShareStats().Received)
	d, err = b.Allow(ctx, "after-close")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Zero(t, plain.Stats().Denials.Received, "a listener without Denials does not listen to them")
}
