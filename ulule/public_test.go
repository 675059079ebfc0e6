package ulule_test

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/ulule/limiter/v3"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
	"github.com/pgrl/pgrl/ulule"
)

// dropPartitions drops every partition of pgrl_fixed_window, as if none had
// been made ahead for the windows the test counts in.
func dropPartitions(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT inhrelid::regclass AS part FROM pg_inherits WHERE inhparent = 'pgrl_fixed_window'::regclass LOOP
    EXECUTE 'DROP TABLE ' || r.part;
  END LOOP;
END $$`)
	require.NoError(t, err)
	var n int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_inherits WHERE inhparent = 'pgrl_fixed_window'::regclass`).Scan(&n))
	require.Zero(t, n)
}

// TestPartitionedLayout: in the partitioned layout the store counts, takes
// hits back and peeks with no partition made ahead: a call that finds none
// for its window creates it.
func TestPartitionedLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	pool := dbtest.PoolOn(t, s)
	m, err := migration.New(dbtest.URLWithSchema(s), migration.Config{Schema: s})
	require.NoError(t, err)
	defer func() { _ = m.Close() }()
	_, err = m.Up(ctx)
	require.NoError(t, err)
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)

	st, err := ulule.NewStore(pool)
	require.NoError(t, err)
	dropPartitions(t, pool)
	for i := int64(1); i <= 4; i++ {
		lc, err := st.Get(ctx, "k", minute3)
		require.NoError(t, err)
		require.Equal(t, i > 3, lc.Reached, "hit %d", i)
	}
	lc, err := st.Peek(ctx, "k", minute3)
	require.NoError(t, err)
	require.True(t, lc.Reached)

	// A negative increment is the store's own statement: it heals too.
	dropPartitions(t, pool)
	lc, err = st.Increment(ctx, "k", -1, minute3)
	require.NoError(t, err)
	require.Equal(t, int64(4), lc.Remaining, "a new window less one hit")
	lc, err = st.Get(ctx, "k", minute3)
	require.NoError(t, err)
	require.Equal(t, int64(3), lc.Remaining)
}

// TestTakeBack: a negative increment takes hits back from the counter the
// positive ones count in (the same stored key, at every period and in both
// key modes), and may leave a count below zero, as Redis's INCRBY does;
// an increment of 0 counts nothing.
func TestTakeBack(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, readable := range []bool{false, true} {
		s, err := ulule.NewStoreWithOptions(pool, ulule.Options{Prefix: "tb", ReadableKeys: readable})
		require.NoError(t, err)
		for _, rate := range []limiter.Rate{minute3, {Period: time.Hour, Limit: 3}, {Period: 24 * time.Hour, Limit: 3}} {
			key := "k" + rate.Period.String()
			_, err := s.Increment(ctx, key, 5, rate)
			require.NoError(t, err)
			lc, err := s.Increment(ctx, key, -4, rate)
			require.NoError(t, err)
			require.Equal(t, int64(2), lc.Remaining, "%v readable=%v", rate.Period, readable)
			require.False(t, lc.Reached)
			lc, err = s.Increment(ctx, key, 0, rate)
			require.NoError(t, err)
			require.Equal(t, int64(2), lc.Remaining, "0 counts nothing")
		}
		lc, err := s.Increment(ctx, "fresh", -2, minute3)
		require.NoError(t, err)
		require.Equal(t, int64(5), lc.Remaining, "3 - (-2)")
		lc, err = s.Increment(ctx, "fresh", 4, minute3)
		require.NoError(t, err)
		require.Equal(t, int64(1), lc.Remaining)
	}
}

// TestTakeBackErrors: the negative increment's errors are typed as every
// other call's: a missing migration and a count below the bigint range are
// returned whatever the policy, an outage goes to the policy.
func TestTakeBackErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bare := dbtest.PoolOn(t, dbtest.NewSchema(t))
	s, err := ulule.NewStoreWithOptions(bare, ulule.Options{OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	_, err = s.Increment(ctx, "k", -1, minute3)
	require.ErrorIs(t, err, ulule.ErrNotMigrated)
	require.Contains(t, err.Error(), "rl-migrate up")

	pool, _ := dbtest.Pool(t)
	s, err = ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	_, err = s.Increment(ctx, "low", math.MinInt64, minute3)
	require.NoError(t, err)
	_, err = s.Increment(ctx, "low", -1, minute3)
	require.ErrorIs(t, err, ulule.ErrInvalidCount)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)

	open, err := ulule.NewStoreWithOptions(unreachable(t), ulule.Options{OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	lc, err := open.Increment(ctx, "k", -1, minute3)
	require.NoError(t, err)
	require.Equal(t, int64(3), lc.Remaining, "the policy answered")
}

// TestReadableKeyLimits: a readable key longer than ratelimit allows is the
// caller's error, never answered by the policy; a prefix too long for a
// readable name is refused at construction.
func TestReadableKeyLimits(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	s, err := ulule.NewStoreWithOptions(pool, ulule.Options{ReadableKeys: true, OnFailure: ulule.FailOpen})
	require.NoError(t, err)
	long := strings.Repeat("x", ratelimit.MaxReadableKeyBytes+1)
	_, err = s.Get(ctx, long, minute3)
	require.ErrorIs(t, err, ulule.ErrKeyTooLong)
	_, err = s.Peek(ctx, long, minute3)
	require.ErrorIs(t, err, ulule.ErrKeyTooLong)
	_, err = s.Reset(ctx, long, minute3)
	require.ErrorIs(t, err, ulule.ErrKeyTooLong)
	_, err = s.Increment(ctx, long, -1, minute3)
	require.ErrorIs(t, err, ulule.ErrKeyTooLong)

	_, err = ulule.NewStoreWithOptions(pool, ulule.Options{ReadableKeys: true, Prefix: strings.Repeat("p", ratelimit.MaxReadableNameBytes+1)})
	require.ErrorIs(t, err, ulule.ErrInvalidPrefix)
}

// TestOutageBeyondTheBreaker: ratelimit's breaker opens after repeated
// failures; the store's policy still answers every call, and a caller
// whose context has ended still gets its context's error.
func TestOutageBeyondTheBreaker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, err := ulule.NewStoreWithOptions(unreachable(t), ulule.Options{OnFailure: ulule.FailClosed})
	require.NoError(t, err)
	for i := range 3 * ratelimit.DefaultBreakerThreshold {
		lc, err := s.Get(ctx, "k", minute3)
		require.NoError(t, err, "call %d", i)
		require.True(t, lc.Reached, "call %d", i)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = s.Get(cctx, "k", minute3)
	require.ErrorIs(t, err, context.Canceled)
}
