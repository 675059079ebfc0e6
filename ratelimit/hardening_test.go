package ratelimit_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestExtremeLimitsDecideExactly: the largest limits the config accepts give
// exact decisions in PostgreSQL (single and coalesced statements) and in
// memory, with and without penalty, and never a negative Remaining.
func TestExtremeLimitsDecideExactly(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	const maxTokens = int64(1) << 53
	cases := []struct {
		alg          ratelimit.Algorithm
		limit, burst int64
	}{
		{ratelimit.FixedWindow, math.MaxInt64, 0},
		{ratelimit.SlidingWindow, math.MaxInt64, 0},
		{ratelimit.TokenBucket, maxTokens, maxTokens},
		{ratelimit.TokenBucket, math.MaxInt64, maxTokens},
	}
	for ci, c := range cases {
		for _, penalty := range []bool{false, true} {
			cfg := ratelimit.Config{
				Name: "extreme", Algorithm: c.alg, Limit: c.limit, Burst: c.burst, Window: time.Hour,
				Penalty: penalty, DenyCacheSize: -1,
			}
			capacity := c.limit
			if c.burst > 0 {
				capacity = c.burst
			}
			now := testkit.Pinned(base.Add(time.Minute))
			l, err := testkit.New(pool, cfg, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: now})
			require.NoError(t, err, "%s limit %d burst %d", c.alg, c.limit, c.burst)
			m, err := ratelimit.NewMemory(cfg, ratelimit.MemoryOptions{Now: now})
			require.NoError(t, err)
			key := fmt.Sprintf("%s-%d-penalty=%v", c.alg, ci, penalty)
			check := func(what string, allow func(key string, n int64) (ratelimit.Decision, error), peek func(key string) (ratelimit.Decision, error)) {
				d, err := allow(key, 1)
				require.NoError(t, err, what)
				require.True(t, d.Allowed, what)
				require.Equal(t, capacity-1, d.Remaining, what)
				d, err = allow(key, capacity-1)
				require.NoError(t, err, what)
				require.True(t, d.Allowed, what)
				require.Zero(t, d.Remaining, what)
				for i := range 3 {
					d, err = allow(key, 1)
					require.NoError(t, err, "%s: a full key, check %d", what, i)
					require.False(t, d.Allowed, "%s: a full key is admitted again (check %d)", what, i)
					require.Zero(t, d.Remaining, what)
					require.Positive(t, d.RetryAfter, what)
				}
				d, err = allow(key, capacity)
				require.NoError(t, err, what)
				require.False(t, d.Allowed, what)
				p, err := peek(key)
				require.NoError(t, err, what)
				require.False(t, p.Allowed, what)
				require.Zero(t, p.Remaining, what)
			}
			check("postgres "+key, func(k string, n int64) (ratelimit.Decision, error) {
				d, err := l.Allow(ctx, k, ratelimit.Cost(n))
				if err == nil && d.Store != ratelimit.StorePostgres {
					return d, errors.New("answered by " + string(d.Store) + ": " + d.Reason)
				}
				return d, err
			}, func(k string) (ratelimit.Decision, error) { return l.Peek(ctx, k) })
			check("memory "+key, func(k string, n int64) (ratelimit.Decision, error) { return m.Allow(ctx, k, ratelimit.Cost(n)) },
				func(k string) (ratelimit.Decision, error) { return m.Peek(ctx, k) })
			// The coalesced statement: two keys at once.
			keys := []string{key + "-a", key + "-b"}
			ds, err := ratelimit.TakeMany(ctx, l, keys, []int64{capacity, 1})
			require.NoError(t, err)
			require.True(t, ds[0].Allowed && ds[1].Allowed)
			require.Equal(t, []int64{0, capacity - 1}, []int64{ds[0].Remaining, ds[1].Remaining})
			for range 2 {
				ds, err = ratelimit.TakeMany(ctx, l, keys, []int64{1, capacity})
				require.NoError(t, err, "batch %s", key)
				require.False(t, ds[0].Allowed, "batch %s: a full key is admitted again", key)
				require.False(t, ds[1].Allowed, "batch %s", key)
				require.Zero(t, ds[0].Remaining)
				require.GreaterOrEqual(t, ds[1].Remaining, int64(0))
			}
		}
	}
}

// TestUncomputableConfigsRefusedAtNew: what the SQL cannot compute exactly
// is refused at New with a typed error naming the fix.
func TestUncomputableConfigsRefusedAtNew(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	cases := []struct {
		cfg  ratelimit.Config
		want error
		text string
	}{
		{ratelimit.Config{Algorithm: ratelimit.TokenBucket, Limit: math.MaxInt64, Window: time.Minute}, ratelimit.ErrInvalidBurst, "at most 9007199254740992"},
		{ratelimit.Config{Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: math.MaxInt64, Window: time.Minute}, ratelimit.ErrInvalidBurst, "at most 9007199254740992"},
		{ratelimit.Config{Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: 1 << 53, Window: time.Minute}, ratelimit.ErrInvalidBurst, "refill"},
		{ratelimit.Config{Algorithm: ratelimit.TokenBucket, Limit: 1, Burst: 1000, Window: ratelimit.MaxWindow}, ratelimit.ErrInvalidBurst, "1,000 years"},
		{ratelimit.Config{Limit: 5, Window: time.Minute, KeyMode: ratelimit.ReadableKeys, Name: strings.Repeat("n", ratelimit.MaxReadableNameBytes+1)}, ratelimit.ErrInvalidName, "256"},
	}
	for _, c := range cases {
		if c.cfg.Name == "" {
			c.cfg.Name = "refused"
		}
		_, err := testkit.New(pool, c.cfg)
		require.ErrorIs(t, err, c.want, "%+v", c.cfg)
		require.Contains(t, err.Error(), c.text)
		_, err = ratelimit.NewMemory(c.cfg, ratelimit.MemoryOptions{})
		if c.want != ratelimit.ErrInvalidName { // names do not reach a table in memory
			require.ErrorIs(t, err, c.want)
		}
	}
	// A bucket that refills in decades (1 a second, burst 1e9) is accepted
	// and decides exactly.
	ctx := context.Background()
	l, err := testkit.New(pool, ratelimit.Config{Name: "slow", Algorithm: ratelimit.TokenBucket, Limit: 1, Burst: 1e9, Window: time.Second, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: testkit.Pinned(base)})
	require.NoError(t, err)
	d, err := l.Allow(ctx, "k", ratelimit.Cost(1e9))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	require.Equal(t, base.Add(1e9*time.Second), d.ResetAt.UTC())
	d, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, time.Second, d.RetryAfter)
}

// TestInputErrorsNeverReachTheFailurePolicy: an error PostgreSQL raises
// because of the input (here a pinned clock beyond its timestamp range) is a
// typed error to the caller on every path, never a memory answer, and never
// opens the breaker.
func TestInputErrorsNeverReachTheFailurePolicy(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	far := time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "bad-" + string(alg), Algorithm: alg, Limit: 5, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(far)})
		isInput := func(what string, err error) {
			t.Helper()
			require.ErrorIs(t, err, ratelimit.ErrInvalidInput, "%s %s", alg, what)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr, "%s %s", alg, what)
			require.Equal(t, "22", pgErr.Code[:2], "%s %s", alg, what)
		}
		for range 10 {
			_, err := l.Allow(ctx, "k")
			isInput("Allow", err)
		}
		require.False(t, l.BreakerOpen(), "%s: bad input opened the breaker", alg)
		_, err := l.Peek(ctx, "k")
		isInput("Peek", err)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = l.AllowTx(ctx, tx, "k")
		isInput("AllowTx", err)
		require.NoError(t, tx.Rollback(ctx))
		_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
		isInput("AllowAll", err)
		require.False(t, l.BreakerOpen())
	}
}

// TestBadCheckInABatchSparesTheOthers: when one check of a coalesced
// statement is refused for its input, the others are decided by PostgreSQL
// and the bad one gets its typed error.
func TestBadCheckInABatchSparesTheOthers(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	long := randomKey(t, 3000)
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "batch", Algorithm: alg, Limit: 5, Window: time.Minute, KeyMode: ratelimit.ReadableKeys})
		ds, errs := ratelimit.SendBatch(ctx, l, []string{"a", long, "b"}, []int64{1, 1, 2})
		for _, i := range []int{0, 2} {
			require.NoError(t, errs[i], alg)
			require.True(t, ds[i].Allowed, alg)
			require.Equal(t, ratelimit.StorePostgres, ds[i].Store, alg)
		}
		require.ErrorIs(t, errs[1], ratelimit.ErrInvalidInput, alg)
		require.False(t, l.BreakerOpen())
	}
}

func randomKey(t *testing.T, n int) string {
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return string(b)
}

// TestReadableKeyLength: a readable key longer than MaxReadableKeyBytes is
// refused up front on every path, without a round trip and without touching
// the breaker; the longest accepted key with the longest accepted name is
// stored in every table.
func TestReadableKeyLength(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	long := randomKey(t, 3000)
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "readable", Algorithm: alg, Limit: 5, Window: time.Minute, KeyMode: ratelimit.ReadableKeys})
		tooLong := func(what string, err error) {
			t.Helper()
			require.ErrorIs(t, err, ratelimit.ErrKeyTooLong, "%s %s", alg, what)
			require.Contains(t, err.Error(), "HashedKeys", "%s %s", alg, what)
		}
		for range 10 {
			_, err := l.Allow(ctx, long)
			tooLong("Allow", err)
		}
		require.False(t, l.BreakerOpen(), "%s: long keys opened the breaker", alg)
		d, err := l.Allow(ctx, "short")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		_, err = l.Peek(ctx, long)
		tooLong("Peek", err)
		tooLong("Reset", l.Reset(ctx, long))
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, err = l.AllowTx(ctx, tx, long)
		tooLong("AllowTx", err)
		_, err = l.PeekTx(ctx, tx, long)
		tooLong("PeekTx", err)
		tooLong("ResetTx", l.ResetTx(ctx, tx, long))
		require.NoError(t, tx.Rollback(ctx))
		_, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: l, Key: "short"}, ratelimit.Check{Limiter: l, Key: long})
		tooLong("AllowAll", err)

		// The longest accepted name and key, incompressible.
		name := strings.Repeat("n", ratelimit.MaxReadableNameBytes)
		edge := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Algorithm: alg, Limit: 5, Window: time.Minute, KeyMode: ratelimit.ReadableKeys, Spread: 3})
		key := randomKey(t, ratelimit.MaxReadableKeyBytes)
		for range 2 {
			d, err := edge.Allow(ctx, key)
			require.NoError(t, err, alg)
			require.Equal(t, ratelimit.StorePostgres, d.Store, alg)
		}
		_, err = edge.Peek(ctx, key)
		require.NoError(t, err)
		require.NoError(t, edge.Reset(ctx, key))
	}
}

// TestSpreadWithDenyCacheAdmitsTheLimit: with Spread and the default deny
// cache, one caller is admitted exactly Limit units: a row's denial is
// cached for that row, not for the whole key.
func TestSpreadWithDenyCacheAdmitsTheLimit(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "spread", Algorithm: alg, Limit: 100, Spread: 7, Window: time.Minute}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base.Add(time.Second))})
		admitted, cached := 0, 0
		for range 300 {
			d, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if d.Allowed {
				admitted++
			}
			if d.Store == ratelimit.StoreDenyCache {
				cached++
			}
		}
		require.Equal(t, 100, admitted, alg)
		require.Positive(t, cached, "%s: the deny cache still answers denied rows", alg)
		// Reset forgets the rows' cached denials too.
		require.NoError(t, l.Reset(ctx, "k"))
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed, alg)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
	}
}

// TestWindowsBefore1970: windows are aligned by flooring, also on instants
// before the Unix epoch, in PostgreSQL, in memory and in multi-limit
// decisions.
func TestWindowsBefore1970(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	at := time.Date(1969, 12, 31, 23, 58, 30, 0, time.UTC)
	wantReset := map[ratelimit.Algorithm]time.Time{
		ratelimit.FixedWindow:   time.Date(1969, 12, 31, 23, 59, 0, 0, time.UTC),
		ratelimit.SlidingWindow: time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC), // start 23:58 + 2 windows
	}
	for alg, want := range wantReset {
		cfg := ratelimit.Config{Name: "pre1970", Algorithm: alg, Limit: 2, Window: time.Minute}
		l := testkit.NewLimiter(t, pool, cfg, ratelimit.DatabaseOptions{Now: testkit.Pinned(at)})
		m, err := ratelimit.NewMemory(cfg, ratelimit.MemoryOptions{Now: testkit.Pinned(at)})
		require.NoError(t, err)
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.Equal(t, want, d.ResetAt.UTC(), "%s postgres", alg)
		md, err := m.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, want, md.ResetAt.UTC(), "%s memory", alg)
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Remaining, "%s peek sees the check", alg)
		md2, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
		require.NoError(t, err, alg)
		require.True(t, md2.Allowed, alg)
		require.Equal(t, ratelimit.StorePostgres, md2.Decisions[0].Store)
		d, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, d.Allowed, "%s: the third check of limit 2", alg)
		if alg == ratelimit.FixedWindow {
			require.Equal(t, 30*time.Second, d.RetryAfter)
		}
	}
}

// TestPermissionErrors: a user without the grants pgrl needs is told which
// grant is missing, not to run migrations; the PgError stays reachable.
func TestPermissionErrors(t *testing.T) {
	t.Parallel()
	_, schema := dbtest.Pool(t)
	admin := dbtest.Admin(t)
	ctx := context.Background()
	role := "pgrl_noperm_" + strings.TrimPrefix(schema, "pgrl_test_")
	_, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+role)
	})
	pool := dbtest.PoolOn(t, schema, func(c *pgxpool.Config) { c.ConnConfig.User = role })
	ident := pgx.Identifier{schema}.Sanitize()
	expect := func(what, grant, code string, err error) {
		t.Helper()
		require.ErrorIs(t, err, ratelimit.ErrPermission, what)
		require.NotErrorIs(t, err, ratelimit.ErrNotMigrated, what)
		require.Contains(t, err.Error(), grant, what)
		require.NotContains(t, err.Error(), "rl-migrate up", what)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, what)
		require.Equal(t, code, pgErr.Code, what)
	}
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "perm", Algorithm: alg, Limit: 5, Window: time.Minute})
		_, err := l.Allow(ctx, "k")
		// 42P01: a check's INSERT names its table first, and the hidden
		// schema hides it (and pgrl's functions, which a peek names first:
		// 42883).
		expect(string(alg)+" no USAGE", "GRANT USAGE ON SCHEMA", "42P01", err)
		_, err = l.Peek(ctx, "k")
		expect(string(alg)+" no USAGE, Peek", "GRANT USAGE ON SCHEMA", "42883", err)
		require.False(t, l.BreakerOpen())
	}
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+ident+" TO "+role)
	require.NoError(t, err)
	for _, alg := range ratelimit.Algorithms {
		l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "perm", Algorithm: alg, Limit: 5, Window: time.Minute})
		_, err := l.Allow(ctx, "k")
		expect(string(alg)+" no table rights", "SELECT, INSERT, UPDATE, DELETE", "42501", err)
		expect(string(alg)+" no table rights, Reset", "SELECT, INSERT, UPDATE, DELETE", "42501", l.Reset(ctx, "k"))
	}
	_, err = admin.Exec(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "+ident+" TO "+role)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA "+ident+" FROM PUBLIC")
	require.NoError(t, err)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "perm", Limit: 5, Window: time.Minute})
	_, err = l.Allow(ctx, "k")
	// The planner inlines the arithmetic functions only for a user who may
	// execute them: without EXECUTE, a single check is refused too.
	expect("Allow without EXECUTE", "GRANT EXECUTE", "42501", err)
	_, err = admin.Exec(ctx, "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "+ident+" TO "+role)
	require.NoError(t, err)
	// A multi-limit decision of one algorithm is one call of its check
	// function; a single check is not.
	_, err = admin.Exec(ctx, "REVOKE EXECUTE ON FUNCTION "+ident+".pgrl_fixed_window_take_checks"+
		"(bytea[], bigint[], bigint[], boolean[], integer[], integer[], integer[], bigint[], boolean[], boolean[], bigint[], bigint[], timestamptz)"+
		" FROM "+role)
	require.NoError(t, err)
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k"})
	expect("AllowAll without EXECUTE", "GRANT EXECUTE", "42501", err)
}
