package ratelimit_test

import (
	"context"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestNewDatabaseRefusesBadOptions: a nil database and out-of-range options
// are refused with typed errors that name the field, before anything runs.
func TestNewDatabaseRefusesBadOptions(t *testing.T) {
	t.Parallel()
	_, err := ratelimit.NewDatabase(nil, ratelimit.DatabaseOptions{})
	require.ErrorIs(t, err, ratelimit.ErrNilDB)
	pool, _ := dbtest.Pool(t)
	for _, tc := range []struct {
		opts  ratelimit.DatabaseOptions
		want  error
		field string
	}{
		{ratelimit.DatabaseOptions{Timeout: -time.Nanosecond}, ratelimit.ErrInvalidTimeout, "Timeout"},
		{ratelimit.DatabaseOptions{BreakerThreshold: -1}, ratelimit.ErrInvalidOption, "BreakerThreshold"},
		{ratelimit.DatabaseOptions{BreakerCooldown: -time.Second}, ratelimit.ErrInvalidTimeout, "BreakerCooldown"},
		{ratelimit.DatabaseOptions{ShareMinRetryAfter: -time.Second}, ratelimit.ErrInvalidTimeout, "ShareMinRetryAfter"},
		{ratelimit.DatabaseOptions{MaxBatch: -1}, ratelimit.ErrInvalidOption, "MaxBatch"},
		{ratelimit.DatabaseOptions{MaxInFlight: -9223372036854775807}, ratelimit.ErrInvalidOption, "MaxInFlight"},
	} {
		_, err := ratelimit.NewDatabase(pool, tc.opts)
		require.ErrorIs(t, err, tc.want, "%+v", tc.opts)
		require.ErrorContains(t, err, "DatabaseOptions."+tc.field)
		require.ErrorContains(t, err, "use a positive")
		require.True(t, ratelimit.IsConfigError(err))
	}
	db, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{})
	require.NoError(t, err)
	l, err := db.Limiter(ratelimit.Config{Name: "defaults", Limit: 1, Window: time.Minute})
	require.NoError(t, err)
	c := db.Options()
	require.Equal(t, c, ratelimit.OptionsOf(l), "the limit uses its Database's options")
	require.Equal(t, ratelimit.DefaultTimeout, c.Timeout, "a check's wait is bounded by default")
	require.Equal(t, ratelimit.DefaultBreakerThreshold, c.BreakerThreshold)
	require.Equal(t, ratelimit.DefaultMaxBatch, c.MaxBatch)
	require.Equal(t, ratelimit.DefaultShareMinRetryAfter, c.ShareMinRetryAfter)
	require.Nil(t, c.Now, "the database's clock decides by default")
	require.NotNil(t, c.Logger)
}

// TestPerDatabaseFieldsOnlyInDatabaseOptions: a limit made from a Database
// takes what is per database from it; no such field can be set on the
// limit as well (Config has none of them: each is a DatabaseOptions
// field), so that no setting is silently ignored.
func TestPerDatabaseFieldsOnlyInDatabaseOptions(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	db, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{})
	require.NoError(t, err)
	ok := ratelimit.Config{Name: "per-db", Limit: 5, Window: time.Minute}
	for _, field := range []string{"Timeout", "BreakerThreshold", "BreakerCooldown", "DisableCoalescing", "MaxBatch",
		"MaxInFlight", "CreatePartitions", "Cleanup", "Observer", "Logger", "ShareMinRetryAfter", "Now"} {
		_, inConfig := reflect.TypeFor[ratelimit.Config]().FieldByName(field)
		require.False(t, inConfig, "Config.%s cannot be set on a limit", field)
		_, inOptions := reflect.TypeFor[ratelimit.DatabaseOptions]().FieldByName(field)
		require.True(t, inOptions, "DatabaseOptions.%s is set instead", field)
	}
	bad := ok
	bad.Limit = -1
	_, err = db.Limiter(bad)
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit, "the limit's own rules still apply")
	l, err := db.Limiter(ok)
	require.NoError(t, err)
	require.Equal(t, ratelimit.DefaultTimeout, ratelimit.OptionsOf(l).Timeout, "the limit uses the Database's options")
}

// TestDatabaseSharesCoalescerAndBreaker: every limit of one Database puts
// its checks into the same coalesced statements, and one judgement of the
// database's health holds for all of them: failures seen by one limit open
// the breaker for the others, whose checks are then answered by their
// failure policy without a round trip, and the Observer hears of it once
// per limit.
func TestDatabaseSharesCoalescerAndBreaker(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	live, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{})
	require.NoError(t, err)
	a, err := live.Limiter(ratelimit.Config{Name: "shared-a", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	b, err := live.Limiter(ratelimit.Config{Name: "shared-b", Algorithm: ratelimit.TokenBucket, Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	require.True(t, ratelimit.SharesCoalescer(a, b), "one coalescer per Database")
	alone, err := testkit.New(pool, ratelimit.Config{Name: "shared-a", Limit: 5, Window: time.Minute}, ratelimit.DatabaseOptions{MaxBatch: 7})
	require.NoError(t, err)
	require.False(t, ratelimit.SharesCoalescer(a, alone), "a limiter with other coalescer settings has its own")

	// A database that refuses connections: a real failure on every check.
	dead := &testkit.CountingDB{Pool: testkit.DeadPool(t)}
	events := &testkit.Observer{}
	down, err := ratelimit.NewDatabase(dead, ratelimit.DatabaseOptions{BreakerThreshold: 2, BreakerCooldown: time.Hour,
		Observer: events, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	x, err := down.Limiter(ratelimit.Config{Name: "down-x", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	y, err := down.Limiter(ratelimit.Config{Name: "down-y", Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Minute,
		OnFailure: ratelimit.FailClosed})
	require.NoError(t, err)
	ctx := context.Background()
	for range 2 {
		d, err := x.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StoreMemory, d.Store, "FailToMemory answers while the database is down")
	}
	require.True(t, x.BreakerOpen(), "two failures of x open the Database's breaker")
	require.True(t, y.BreakerOpen(), "and y sees it open, without a failure of its own")
	sent := dead.Statements()
	d, err := y.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed, "y's own failure policy (FailClosed) answers")
	require.Equal(t, ratelimit.StorePolicy, d.Store)
	require.Equal(t, sent, dead.Statements(), "no round trip while the breaker is open")
	require.ElementsMatch(t, []string{"open down-x", "open down-y"}, events.BreakerEvents(), "the Observer hears once per limit")
}

// TestDatabaseClockDecidesEveryTier: a Database's pinned clock
// (DatabaseOptions.Now) is the instant of every decision of its limits: in
// PostgreSQL, and in the memory fallback when the database is down.
func TestDatabaseClockDecidesEveryTier(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	c := testkit.NewClock(base.Add(17 * time.Second))
	live := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: c.Now})
	dead := testkit.NewDatabase(t, testkit.DeadPool(t), ratelimit.DatabaseOptions{Now: c.Now, Timeout: 200 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)})
	for _, alg := range ratelimit.Algorithms {
		cfg := ratelimit.Config{Name: "clock-" + string(alg), Algorithm: alg, Limit: 2, Window: time.Minute}
		for _, db := range []*ratelimit.Database{live, dead} {
			l := testkit.Limiter(t, db, cfg)
			want := ratelimit.StorePostgres
			if db == dead {
				want = ratelimit.StoreMemory
			}
			for i := range 3 {
				c.Add(time.Second)
				d, err := l.Allow(ctx, "k")
				require.NoError(t, err)
				require.Equal(t, want, d.Store, "%s check %d", alg, i)
				require.True(t, d.Now.Equal(c.Now()), "%s %s check %d: decided at %v, not the Database's %v", alg, want, i, d.Now, c.Now())
				require.Equal(t, i < 2, d.Allowed, "%s %s check %d", alg, want, i)
			}
		}
	}
}
