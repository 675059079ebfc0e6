package ulule_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/ulule/limiter/v3"
	"github.com/ulule/limiter/v3/drivers/store/memory"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
	"github.com/pgrl/pgrl/ulule"
)

var minute3 = limiter.Rate{Period: time.Minute, Limit: 3}

// TestSemantics pins ulule's contract hit by hit: every hit counts, Reached
// only past the limit, Remaining never negative, Reset within one period,
// Increment by several, a negative increment takes hits back.
func TestSemantics(t *testing.T) {
	t.Parallel()
	s := newStore(t, ulule.Options{})
	ctx := context.Background()
	for i := int64(1); i <= 5; i++ {
		lc, err := s.Get(ctx, "k", minute3)
		require.NoError(t, err)
		require.Equal(t, max(3-i, 0), lc.Remaining, "hit %d", i)
		require.Equal(t, i > 3, lc.Reached, "hit %d", i)
		require.Equal(t, int64(3), lc.Limit)
		require.LessOrEqual(t, lc.Reset-time.Now().Unix(), int64(60))
		require.Zero(t, lc.Reset%60, "a one-minute window ends on a whole minute")
	}
	lc, err := s.Increment(ctx, "k", -3, minute3)
	require.NoError(t, err)
	require.Equal(t, int64(1), lc.Remaining)
	require.False(t, lc.Reached)
	lc, err = s.Increment(ctx, "other", 4, minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached)
	lc, err = s.Peek(ctx, "never", minute3)
	require.NoError(t, err)
	require.Equal(t, int64(3), lc.Remaining)
	require.NotZero(t, lc.Reset)
}

// TestResetForgetsEveryWindow: Reset removes the key's rows, not only the
// current window's; other keys and other periods keep theirs.
func TestResetForgetsOnlyTheKey(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	s, err := ulule.NewStore(pool)
	require.NoError(t, err)
	ctx := context.Background()
	hour := limiter.Rate{Period: time.Hour, Limit: 3}
	for _, k := range []string{"a", "b"} {
		_, err := s.Increment(ctx, k, 2, minute3)
		require.NoError(t, err)
	}
	_, err = s.Increment(ctx, "a", 2, hour)
	require.NoError(t, err)
	lc, err := s.Reset(ctx, "a", minute3)
	require.NoError(t, err)
	require.Equal(t, int64(3), lc.Remaining)
	for _, c := range []struct {
		key  string
		rate limiter.Rate
		want int64
	}{{"a", minute3, 3}, {"b", minute3, 1}, {"a", hour, 1}} {
		lc, err := s.Peek(ctx, c.key, c.rate)
		require.NoError(t, err)
		require.Equal(t, c.want, lc.Remaining, "%s at %v", c.key, c.rate.Period)
	}
}

// TestWindowOnDatabaseClock: the reported reset is the end of the window
// that contains the database's now(), aligned on the period.
func TestWindowOnDatabaseClock(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	s, err := ulule.NewStore(pool)
	require.NoError(t, err)
	rate := limiter.Rate{Period: 7 * time.Second, Limit: 1}
	var before, after time.Time
	ctx := context.Background()
	require.NoError(t, pool.QueryRow(ctx, "SELECT now()").Scan(&before))
	lc, err := s.Get(ctx, "k", rate)
	require.NoError(t, err)
	require.NoError(t, pool.QueryRow(ctx, "SELECT now()").Scan(&after))
	end := func(t time.Time) int64 { return (t.Unix()/7 + 1) * 7 }
	require.Contains(t, []int64{end(before), end(after)}, lc.Reset)
}

// TestKeysHashed: the table holds pgrl's digest of the name
// ratelimit.RateName(prefix, period) ("api@60000000us") and the key,
// never the key; ReadableKeys stores it readably.
func TestKeysHashed(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	hashed, err := ulule.NewStoreWithOptions(pool, ulule.Options{Prefix: "api"})
	require.NoError(t, err)
	readable, err := ulule.NewStoreWithOptions(pool, ulule.Options{Prefix: "web", ReadableKeys: true})
	require.NoError(t, err)
	_, err = hashed.Get(ctx, "alice@example.com", minute3)
	require.NoError(t, err)
	_, err = readable.Get(ctx, "bob", minute3)
	require.NoError(t, err)
	var keys [][]byte
	rows, err := pool.Query(ctx, "SELECT key FROM pgrl_fixed_window ORDER BY length(key)")
	require.NoError(t, err)
	for rows.Next() {
		var k []byte
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, [][]byte{
		ratelimit.StoredKey(ratelimit.HashedKeys, "api@60000000us", "alice@example.com"),
		[]byte("web@60000000us:bob"),
	}, keys)
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := ulule.NewStore(nil)
	require.ErrorIs(t, err, ulule.ErrNilDB)
	var nilPool *pgxpool.Pool
	_, err = ulule.NewStore(nilPool)
	require.ErrorIs(t, err, ulule.ErrNilDB)
	_, err = ulule.NewStoreWithOptions(pool, ulule.Options{Prefix: "a:b", ReadableKeys: true})
	require.ErrorIs(t, err, ulule.ErrInvalidPrefix)
	_, err = ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailToStore})
	require.ErrorIs(t, err, ulule.ErrInvalidPolicy)
	_, err = ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: 42})
	require.ErrorIs(t, err, ulule.ErrInvalidPolicy)
	_, err = ulule.NewStoreWithOptions(pool, ulule.Options{Timeout: -time.Second})
	require.ErrorIs(t, err, ulule.ErrInvalidTimeout)

	// Bad periods and overflowing counts are the caller's errors, even for
	// a store that fails open.
	s, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	for _, p := range []time.Duration{0, -time.Second, time.Microsecond, 400 * 24 * time.Hour, time.Second + time.Nanosecond} {
		_, err := s.Get(ctx, "k", limiter.Rate{Period: p, Limit: 1})
		require.ErrorIs(t, err, ulule.ErrInvalidRate, "period %v", p)
		_, err = s.Peek(ctx, "k", limiter.Rate{Period: p, Limit: 1})
		require.ErrorIs(t, err, ulule.ErrInvalidRate, "period %v", p)
		_, err = s.Reset(ctx, "k", limiter.Rate{Period: p, Limit: 1})
		require.ErrorIs(t, err, ulule.ErrInvalidRate, "period %v", p)
	}
	// A count that would pass the largest bigint stops there (pgrl's
	// penalty arithmetic saturates) instead of failing the request.
	_, err = s.Increment(ctx, "big", 1<<62, minute3)
	require.NoError(t, err)
	for range 3 {
		lc, err := s.Increment(ctx, "big", 1<<62, minute3)
		require.NoError(t, err)
		require.True(t, lc.Reached)
		require.Zero(t, lc.Remaining)
	}
	lc, err := s.Peek(ctx, "big", minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached, "a saturated window stays reached")
	// Any bytes are a key.
	for _, k := range []string{"", "\x00", "\xff\xfe", strings.Repeat("x", 1<<20)} {
		lc, err := s.Get(ctx, k, minute3)
		require.NoError(t, err)
		require.Equal(t, int64(2), lc.Remaining)
	}
}

// TestNotMigrated: a schema without pgrl's tables gives ErrNotMigrated,
// whatever the failure policy.
func TestNotMigrated(t *testing.T) {
	t.Parallel()
	pool := dbtest.PoolOn(t, dbtest.NewSchema(t))
	for _, p := range []ulule.FailurePolicy{ulule.FailError, ulule.FailOpen, ulule.FailClosed} {
		s, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: p})
		require.NoError(t, err)
		_, err = s.Get(context.Background(), "k", minute3)
		require.ErrorIs(t, err, ulule.ErrNotMigrated, p.String())
		require.Contains(t, err.Error(), "rl-migrate up")
		_, err = s.Peek(context.Background(), "k", minute3)
		require.ErrorIs(t, err, ulule.ErrNotMigrated, p.String())
		_, err = s.Reset(context.Background(), "k", minute3)
		require.ErrorIs(t, err, ulule.ErrNotMigrated, p.String())
	}
}

// unreachable returns a pool on a port where nothing listens: every call
// fails to connect, for real.
func unreachable(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestFailurePolicies drives each policy through a real outage: a server
// that refuses connections.
func TestFailurePolicies(t *testing.T) {
	t.Parallel()
	pool := unreachable(t)
	ctx := context.Background()

	s, err := ulule.NewStore(pool)
	require.NoError(t, err)
	_, err = s.Get(ctx, "k", minute3)
	require.Error(t, err, "the default returns the error, as ulule's Redis store does")
	_, err = s.Peek(ctx, "k", minute3)
	require.Error(t, err)

	open, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	lc, err := open.Get(ctx, "k", minute3)
	require.NoError(t, err)
	require.Equal(t, limiter.Context{Limit: 3, Remaining: 3, Reset: lc.Reset}, lc)
	require.InDelta(t, time.Now().Add(time.Minute).Unix(), lc.Reset, 2)
	_, err = open.Reset(ctx, "k", minute3)
	require.Error(t, err, "a reset cannot be pretended")

	closed, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailClosed})
	require.NoError(t, err)
	lc, err = closed.Increment(ctx, "k", 1, minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached)
	require.Zero(t, lc.Remaining)

	fb, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailToStore, Fallback: memory.NewStore()})
	require.NoError(t, err)
	for i := int64(1); i <= 4; i++ {
		lc, err = fb.Get(ctx, "k", minute3)
		require.NoError(t, err)
		require.Equal(t, i > 3, lc.Reached, "the fallback store counts: hit %d", i)
	}
	lc, err = fb.Peek(ctx, "k", minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached)

	// A caller whose own context has ended gets its error, not the policy.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = open.Get(cctx, "k", minute3)
	require.ErrorIs(t, err, context.Canceled)
}

// TestTimeoutAnswersByPolicy: a check blocked behind a lock on the table
// (taken for real by another transaction) gives up after Options.Timeout
// and the policy answers.
func TestTimeoutAnswersByPolicy(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "LOCK TABLE pgrl_fixed_window IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)

	s, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailClosed, Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	start := time.Now()
	lc, err := s.Get(ctx, "k", minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached)
	require.Less(t, time.Since(start), 10*time.Second)

	plain, err := ulule.NewStoreWithOptions(pool, ulule.Options{Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	_, err = plain.Get(ctx, "k", minute3)
	require.True(t, errors.Is(err, context.DeadlineExceeded), "got %v", err)

	// With no Timeout set, and a caller's context without a deadline, the
	// wait is bounded all the same: by ratelimit.DefaultTimeout.
	byDefault, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailClosed})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		lc, err := byDefault.Get(ctx, "k", minute3)
		if err == nil && !lc.Reached {
			err = errors.New("FailClosed answered allowed")
		}
		done <- err
	}()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * ratelimit.DefaultTimeout):
		t.Fatalf("a call with the default options still waits after %v", 30*ratelimit.DefaultTimeout)
	}

	require.NoError(t, tx.Rollback(ctx))
	lc, err = plain.Get(ctx, "k", minute3)
	require.NoError(t, err)
	require.False(t, lc.Reached)
}
