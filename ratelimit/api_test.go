package ratelimit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestUsedCountsPastTheLimit: Decision.Used is what the key has used after
// the check, so "exactly at the limit" (Used == Limit) and "over it" (Used >
// Limit, under penalty) differ, while Remaining is max(Limit-Used, 0).
func TestUsedCountsPastTheLimit(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "used", Algorithm: alg, Limit: 3, Window: time.Minute,
				Penalty: penalty}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
			// The memory tier on the same pinned clock: on the machine's, a
			// minute's end between two checks would start it afresh.
			m, err := ratelimit.NewMemory(l.Config(), ratelimit.MemoryOptions{Now: testkit.Pinned(base)})
			require.NoError(t, err)
			key := string(alg) + map[bool]string{false: "", true: "-penalty"}[penalty]
			for i := int64(1); i <= 5; i++ {
				d, err := l.Allow(ctx, key)
				require.NoError(t, err)
				want := min(i, 3)
				if penalty {
					want = i // every attempt counts (the bucket's debt stops at -Burst: Used 6)
				}
				require.Equal(t, i <= 3, d.Allowed, "%s check %d", key, i)
				require.Equal(t, want, d.Used, "%s check %d", key, i)
				require.Equal(t, max(3-want, 0), d.Remaining, "%s check %d", key, i)
				md, err := m.Allow(ctx, key)
				require.NoError(t, err)
				require.Equal(t, d.Used, md.Used, "%s check %d: the memory tier reports the same", key, i)
				p, err := l.Peek(ctx, key)
				require.NoError(t, err)
				require.Equal(t, d.Used, p.Used, "%s peek after check %d", key, i)
			}
		}
	}
}

// TestUsedAfterPartialRefillAndSlide: Used rounds a fractional token balance
// and the sliding window's weighted estimate up, so that Used+Remaining is
// Limit.
func TestUsedAfterPartialRefillAndSlide(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base)
	tb := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 4, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	sw := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "sw", Algorithm: ratelimit.SlidingWindow, Limit: 4, Window: time.Minute}, ratelimit.DatabaseOptions{Now: c.Now})
	_, err := tb.Allow(ctx, "k", ratelimit.Cost(4))
	require.NoError(t, err)
	_, err = sw.Allow(ctx, "k", ratelimit.Cost(4))
	require.NoError(t, err)
	c.Add(time.Minute + 20*time.Second) // bucket: 4*80/60 > 4, full; sliding: prev 4 weighs 4*40/60 = 2.67
	d, err := sw.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(3), d.Used)
	require.Equal(t, int64(1), d.Remaining)
	c.Set(base.Add(5 * time.Minute))
	_, err = tb.Allow(ctx, "k", ratelimit.Cost(4))
	require.NoError(t, err)
	c.Add(20 * time.Second) // 4/60 per second: 1.33 tokens back
	d, err = tb.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(3), d.Used)
	require.Equal(t, int64(1), d.Remaining)
}

func TestAllowTx(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "tx", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	d, err := l.AllowTx(ctx, tx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, int64(1), d.Used)
	require.NoError(t, tx.Rollback(ctx))
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(0), p.Used, "rolling back refunds the unit")
	_, err = l.AllowTx(ctx, nil, "k")
	require.ErrorIs(t, err, ratelimit.ErrNilDB)
}

// TestAllowAllTx: the checks run under a savepoint of the caller's
// transaction, which stays usable whether the decision allows, is voted
// down or fails; committing keeps the units, rolling back refunds them.
func TestAllowAllTx(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	perIP := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "ip", Limit: 5, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	perUser := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "user", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	checks := []ratelimit.Check{{Limiter: perIP, Key: "ip"}, {Limiter: perUser, Key: "u"}}
	used := func(l *ratelimit.Limiter, key string) int64 {
		t.Helper()
		d, err := l.Peek(ctx, key)
		require.NoError(t, err)
		return d.Used
	}

	// Rolled back: nothing stays.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	m, err := ratelimit.AllowAllTx(ctx, tx, ratelimit.AllOrNothing, checks...)
	require.NoError(t, err)
	require.True(t, m.Allowed)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, int64(0), used(perIP, "ip"))
	require.Equal(t, int64(0), used(perUser, "u"))

	// Committed: both counted.
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	m, err = ratelimit.AllowAllTx(ctx, tx, ratelimit.AllOrNothing, checks...)
	require.NoError(t, err)
	require.True(t, m.Allowed)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(1), used(perIP, "ip"))
	require.Equal(t, int64(1), used(perUser, "u"))

	// Voted down: the per-IP unit is not consumed, and the caller's
	// transaction goes on and commits its own work.
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	m, err = ratelimit.AllowAllTx(ctx, tx, ratelimit.AllOrNothing, checks...)
	require.NoError(t, err)
	require.False(t, m.Allowed)
	require.Equal(t, 1, m.DeniedBy)
	var one int
	require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one), "the caller's transaction is still usable")
	_, err = perIP.AllowTx(ctx, tx, "ip")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(2), used(perIP, "ip"), "only the AllowTx after the vote counted")

	// A failed decision (bad input) leaves the transaction usable too.
	far := time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)
	bad := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "bad", Limit: 5, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(far)})
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	_, err = ratelimit.AllowAllTx(ctx, tx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: bad, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrInvalidInput)
	require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one))
	require.NoError(t, tx.Rollback(ctx))

	_, err = ratelimit.AllowAllTx(ctx, nil, ratelimit.AllOrNothing, checks...)
	require.ErrorIs(t, err, ratelimit.ErrNilDB)
}

// TestErrorsKeepTheirSentinelAndThePgError: every error PostgreSQL causes
// matches both its sentinel (errors.Is) and the *pgconn.PgError (errors.As).
func TestErrorsKeepTheirSentinelAndThePgError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := ratelimit.Config{Name: "errs", Limit: 5, Window: time.Minute, OnFailure: ratelimit.FailError}
	opts := ratelimit.DatabaseOptions{DisableCoalescing: true}
	both := func(t *testing.T, err error, sentinel error, code string) {
		t.Helper()
		if sentinel != nil {
			require.ErrorIs(t, err, sentinel)
		}
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, code, pgErr.Code)
	}

	t.Run("not migrated", func(t *testing.T) {
		pool := dbtest.PoolOn(t, dbtest.NewSchema(t))
		l := testkit.NewLimiter(t, pool, cfg, opts)
		_, err := l.Allow(ctx, "k")
		// 42P01: a check's INSERT names its table before pgrl's functions,
		// so a schema without them fails there first.
		both(t, err, ratelimit.ErrNotMigrated, "42P01")
		// It says where it looked: the schema, the database and the user.
		require.Contains(t, err.Error(), "pgrl's tables are missing in schema")
		require.Contains(t, err.Error(), "of database")
		require.Contains(t, err.Error(), "(user ")
	})
	t.Run("read only", func(t *testing.T) {
		_, s := dbtest.Pool(t)
		pool := dbtest.PoolOn(t, s, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
		})
		l := testkit.NewLimiter(t, pool, cfg, opts)
		_, err := l.Allow(ctx, "k")
		both(t, err, ratelimit.ErrReadOnly, "25006")
		// A primary whose session is read-only is not called a standby.
		require.NotContains(t, err.Error(), "standby")
		require.Contains(t, err.Error(), "default_transaction_read_only")
	})
	t.Run("outage under FailError", func(t *testing.T) {
		// A statement cancelled by statement_timeout while it waits on the
		// row another transaction holds: an outage, returned as is.
		pool, s := dbtest.Pool(t)
		slow := dbtest.PoolOn(t, s, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["statement_timeout"] = "100"
		})
		holder := testkit.NewLimiter(t, pool, cfg, opts)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = holder.AllowTx(ctx, tx, "k")
		require.NoError(t, err)
		l := testkit.NewLimiter(t, slow, cfg, opts)
		_, err = l.Allow(ctx, "k")
		both(t, err, nil, "57014")
		require.False(t, errors.Is(err, ratelimit.ErrInvalidInput))
	})
}

// TestOneSentinelPerMeaning: options, multi modes and missing limiters
// have errors of their own, no longer those of limits, policies and
// databases.
func TestOneSentinelPerMeaning(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	ok := ratelimit.Config{Name: "s", Limit: 5, Window: time.Minute}
	for _, mod := range []func(*ratelimit.Config, *ratelimit.DatabaseOptions){
		func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.MaxBatch = -1 },
		func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.MaxInFlight = -1 },
		func(c *ratelimit.Config, _ *ratelimit.DatabaseOptions) { c.Spread = -1 },
		func(_ *ratelimit.Config, o *ratelimit.DatabaseOptions) { o.BreakerThreshold = -1 },
	} {
		c := ok
		var o ratelimit.DatabaseOptions
		mod(&c, &o)
		_, err := testkit.New(pool, c, o)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
		require.NotErrorIs(t, err, ratelimit.ErrInvalidLimit)
		require.NotErrorIs(t, err, ratelimit.ErrInvalidTimeout)
	}
	l := testkit.NewLimiter(t, pool, ok)
	_, err := ratelimit.AllowAll(ctx, ratelimit.MultiMode(9), ratelimit.Check{Limiter: l, Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrInvalidMultiMode)
	require.NotErrorIs(t, err, ratelimit.ErrInvalidPolicy)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Key: "k"})
	require.ErrorIs(t, err, ratelimit.ErrNilLimiter)
	require.NotErrorIs(t, err, ratelimit.ErrNilDB)
}

// TestErrNotMigratedIsSharedAcrossPackages: the library, the migrator and
// cleanup return one value, so errors.Is matches whichever a caller tests.
func TestErrNotMigratedIsSharedAcrossPackages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	pool := dbtest.PoolOn(t, s)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "nm", Limit: 5, Window: time.Minute})
	_, err := l.Allow(ctx, "k")
	require.ErrorIs(t, err, migration.ErrNotMigrated)
	require.ErrorIs(t, err, cleanup.ErrNotMigrated)

	m, err := migration.New(dbtest.URLWithSchema(s), migration.Config{Schema: s})
	require.NoError(t, err)
	defer func() { _ = m.Close() }()
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, 0)
	require.ErrorIs(t, err, ratelimit.ErrNotMigrated)
}

// TestPartitionMissingInTxKeepsThePgError: in the partitioned layout, a
// check in the caller's transaction that finds no partition returns
// ErrPartitionMissing with PostgreSQL's error inside (it used to be
// formatted with %v, which errors.As could not find), and the retry in a new
// transaction succeeds.
func TestPartitionMissingInTxKeepsThePgError(t *testing.T) {
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

	// Far ahead of the partitions made for now.
	far := time.Date(2031, 5, 6, 7, 8, 0, 0, time.UTC)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "p", Limit: 3, Window: time.Minute}, ratelimit.DatabaseOptions{CreatePartitions: true, Now: testkit.Pinned(far)})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }() // a failed assertion must not leave the connection busy
	_, err = l.AllowTx(ctx, tx, "k")
	require.ErrorIs(t, err, ratelimit.ErrPartitionMissing)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23514", pgErr.Code)
	require.NoError(t, tx.Rollback(ctx))

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	d, err := l.AllowTx(ctx, tx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.NoError(t, tx.Commit(ctx))
}
