package policy_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

func TestSetGetListDelete(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()

	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute, Description: "public API"})
	require.NoError(t, err)
	require.Equal(t, ratelimit.FixedWindow, p.Algorithm)
	require.False(t, p.CreatedAt.IsZero())
	got, err := policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, p, got)

	p.Algorithm, p.Burst, p.Limit = ratelimit.TokenBucket, 50, 20
	_, err = policy.Set(ctx, pool, p)
	require.NoError(t, err)
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "login", Limit: 3, Window: 15 * time.Minute, Penalty: true, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)
	all, err := policy.List(ctx, pool)
	require.NoError(t, err)
	require.Len(t, all, 2)
	require.Equal(t, "api", all[0].Name)
	require.Equal(t, int64(50), all[0].Burst)
	require.Equal(t, ratelimit.ReadableKeys, all[1].KeyMode)

	require.NoError(t, policy.Delete(ctx, pool, "login"))
	require.ErrorIs(t, policy.Delete(ctx, pool, "login"), policy.ErrNotFound)
	_, err = policy.Get(ctx, pool, "login")
	require.ErrorIs(t, err, policy.ErrNotFound)
	require.ErrorContains(t, err, "rl-policy set login")
}

// Bad input is refused before anything is written, by Set's validation and,
// for plain SQL, by the table's constraints, with a message naming the fix.
func TestBadInputRefused(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, tc := range []struct {
		p    policy.Policy
		want error
	}{
		{policy.Policy{Name: "a", Limit: 0, Window: time.Minute}, ratelimit.ErrInvalidLimit},
		{policy.Policy{Name: "a", Limit: 1, Window: 0}, ratelimit.ErrInvalidWindow},
		{policy.Policy{Name: "a", Limit: 1, Window: time.Minute, Algorithm: "leaky"}, ratelimit.ErrInvalidAlgorithm},
		{policy.Policy{Name: "has space", Limit: 1, Window: time.Minute}, ratelimit.ErrInvalidName},
		{policy.Policy{Name: "", Limit: 1, Window: time.Minute}, ratelimit.ErrInvalidName},
		{policy.Policy{Name: "a@b", Limit: 1, Window: time.Minute}, ratelimit.ErrInvalidName},
		{policy.Policy{Name: "a:b", Limit: 1, Window: time.Minute, KeyMode: ratelimit.ReadableKeys}, ratelimit.ErrInvalidName},
		{policy.Policy{Name: "a", Limit: 1, Window: time.Minute, Algorithm: ratelimit.TokenBucket, Burst: ratelimit.MaxTokens + 1}, ratelimit.ErrInvalidBurst},
	} {
		_, err := policy.Set(ctx, pool, tc.p)
		require.ErrorIs(t, err, policy.ErrInvalid, "%+v", tc.p)
		require.ErrorIs(t, err, tc.want, "%+v", tc.p)
	}
	all, err := policy.List(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, all)

	// Plain SQL meets the constraints.
	for _, tc := range []struct{ sql, constraint string }{
		{`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a', 0, '1 minute')`, "pgrl_policy_limit_check"},
		{`INSERT INTO pgrl_policy (name, algorithm, "limit", "window") VALUES ('a', 'leaky', 1, '1 minute')`, "pgrl_policy_algorithm_check"},
		{`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a', 1, '1 month')`, "pgrl_policy_window_check"},
		{`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a', 1, '367 days')`, "pgrl_policy_window_check"},
		{`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a', 1, '0.5 milliseconds')`, "pgrl_policy_window_check"},
		{`INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('a b', 1, '1 minute')`, "pgrl_policy_name_check"},
		{`INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst) VALUES ('a', 'token_bucket', 1, '366 days', 9007199254740992)`, "pgrl_policy_token_bucket_check"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('missing', '\x01', 5)`, "pgrl_policy_override_policy_fkey"},
	} {
		_, err := pool.Exec(ctx, tc.sql)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), tc.sql)
		require.Equal(t, tc.constraint, pgErr.ConstraintName, tc.sql)
	}
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "p", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	for _, tc := range []struct{ sql, constraint string }{
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('p', '\x01', 0)`, "pgrl_policy_override_limit_check"},
		{`INSERT INTO pgrl_policy_override (policy, key) VALUES ('p', '\x01')`, "pgrl_policy_override_something_check"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('p', '', 3)`, "pgrl_policy_override_key_check"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('p', convert_to(repeat('k', 2306), 'UTF8'), 3)`, "pgrl_policy_override_key_check"},
	} {
		_, err := pool.Exec(ctx, tc.sql)
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), tc.sql)
		require.Equal(t, tc.constraint, pgErr.ConstraintName, tc.sql)
	}

	p, err := policy.Get(ctx, pool, "p")
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "missing", Key: p.StoredKey("k"), Limit: 3})
	require.ErrorIs(t, err, policy.ErrNotFound)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "p", Key: p.StoredKey("k")})
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorContains(t, err, "at least one of limit, window and burst")
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "p", Key: p.StoredKey("k"), Window: 400 * 24 * time.Hour})
	require.ErrorIs(t, err, ratelimit.ErrInvalidWindow)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "p", Key: []byte(strings.Repeat("k", 2306)), Limit: 3})
	require.ErrorIs(t, err, ratelimit.ErrKeyTooLong)
	os, err := policy.ListOverrides(ctx, pool, "")
	require.NoError(t, err)
	require.Empty(t, os, "nothing half-written")
}

// pgrl_stored_key in SQL is ratelimit.StoredKey.
func TestStoredKeyInSQL(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, name := range []string{"api", strings.Repeat("n", 127), strings.Repeat("é", 100), strings.Repeat("x", 20000)} {
		for _, key := range []string{"", "203.0.113.7", "ada@example.com", strings.Repeat("k", 300)} {
			for _, mode := range []ratelimit.KeyMode{ratelimit.HashedKeys, ratelimit.ReadableKeys} {
				var got []byte
				require.NoError(t, pool.QueryRow(ctx, `SELECT pgrl_stored_key($1, $2, $3)`, name, key, mode == ratelimit.ReadableKeys).Scan(&got))
				require.Equal(t, hex.EncodeToString(ratelimit.StoredKey(mode, name, key)), hex.EncodeToString(got), "name of %d bytes", len(name))
			}
		}
	}
}

func TestOverridesAndExplain(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	l, err := newLimiter(ctx, pool, "api", policy.Options{})
	require.NoError(t, err)

	// A DBA raises one tenant's limit with plain SQL.
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit", note)
		VALUES ('api', pgrl_stored_key('api', 'tenant-42'), 5, 'enterprise plan')`)
	require.NoError(t, err)
	// An override that has expired (SetOverride refuses a past expiry).
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit", expires_at)
		VALUES ('api', pgrl_policy_key('api', 'old'), 9, now() - interval '1 minute')`)
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("old"), Limit: 9, ExpiresAt: time.Now().Add(-time.Minute)})
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorContains(t, err, "not in the future on the database's clock")
	require.ErrorContains(t, err, "delete it")
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("soon"), Limit: 9, ExpiresAt: time.Now().Add(time.Hour)})
	require.NoError(t, err, "a future expiry is taken")
	require.NoError(t, policy.DeleteOverride(ctx, pool, "api", p.StoredKey("soon")))
	x, err := policy.Explain(ctx, pool, "api", "old")
	require.NoError(t, err)
	require.NotNil(t, x.Expired, "the refused SetOverride left the expired row as it was")
	require.Equal(t, int64(9), x.Expired.Limit)

	x, err = policy.Explain(ctx, pool, "api", "tenant-42")
	require.NoError(t, err)
	require.NotNil(t, x.Override)
	require.Equal(t, "enterprise plan", x.Override.Note)
	require.Equal(t, ratelimit.Rate{Limit: 5, Window: time.Hour, Burst: 5}, x.Rate)
	require.Equal(t, int64(0), x.Counter.Used)
	x, err = policy.Explain(ctx, pool, "api", "old")
	require.NoError(t, err)
	require.Nil(t, x.Override)
	require.NotNil(t, x.Expired)
	require.Equal(t, int64(2), x.Rate.Limit)

	// The limiter loaded its own cache before the override, and nothing
	// refreshes that one.
	d, err := l.Peek(ctx, "tenant-42")
	require.NoError(t, err)
	require.Equal(t, int64(2), d.Limit)
	cache := policy.NewCache(pool)
	require.NoError(t, cache.Reload(ctx))
	l, err = newLimiter(ctx, pool, "api", policy.Options{Cache: cache})
	require.NoError(t, err)
	for i := 1; i <= 6; i++ {
		d, err := l.Allow(ctx, "tenant-42")
		require.NoError(t, err)
		require.Equal(t, i <= 5, d.Allowed, "check %d", i)
	}
	for i := 1; i <= 3; i++ {
		d, err := l.Allow(ctx, "old")
		require.NoError(t, err)
		require.Equal(t, i <= 2, d.Allowed, "expired override: check %d", i)
	}
	x, err = policy.Explain(ctx, pool, "api", "tenant-42")
	require.NoError(t, err)
	require.Equal(t, int64(5), x.Counter.Used)
	require.False(t, x.Counter.Allowed)

	os, err := policy.ListOverrides(ctx, pool, "api")
	require.NoError(t, err)
	require.Len(t, os, 2)
	require.NoError(t, policy.DeleteOverride(ctx, pool, "api", p.StoredKey("tenant-42")))
	require.ErrorIs(t, policy.DeleteOverride(ctx, pool, "api", p.StoredKey("tenant-42")), policy.ErrNotFound)

	// Deleting the policy cascades to its overrides; its limiter reports it.
	require.NoError(t, policy.Delete(ctx, pool, "api"))
	os, err = policy.ListOverrides(ctx, pool, "")
	require.NoError(t, err)
	require.Empty(t, os)
	require.NoError(t, cache.ReloadPolicy(ctx, "api"))
	_, err = l.Allow(ctx, "k")
	require.ErrorIs(t, err, policy.ErrNotFound)
	_, err = newLimiter(ctx, pool, "api", policy.Options{Cache: cache})
	require.ErrorIs(t, err, policy.ErrNotFound)
}

// The application role reads policies and may not write them; the error
// says who should.
func TestApplicationRoleReadsOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, owner, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	for _, stmt := range []string{
		`GRANT USAGE ON SCHEMA "` + s + `" TO "` + role + `"`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON "` + s + `".pgrl_fixed_window TO "` + role + `"`,
		`GRANT SELECT ON "` + s + `".pgrl_policy, "` + s + `".pgrl_policy_override TO "` + role + `"`,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err)
	}
	app, err := pgxpool.New(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(app.Close)
	l, err := newLimiter(ctx, app, "api", policy.Options{})
	require.NoError(t, err)
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	_, err = policy.Set(ctx, app, policy.Policy{Name: "api", Limit: 1000, Window: time.Hour})
	require.ErrorIs(t, err, policy.ErrPermission)
	require.ErrorContains(t, err, "migration role")
}

// A limiter follows its policy's algorithm and window; an override that a
// changed policy no longer admits is ignored, with one warning, and the
// policy applies.
func TestLimiterFollowsPolicyChanges(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 1, Window: time.Hour})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("big"), Burst: ratelimit.MaxTokens})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	require.NoError(t, cache.Reload(ctx))
	var logs testkit.LogBuffer
	lim, err := newLimiter(ctx, pool, "api", policy.Options{Cache: cache,
		Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Logger: slog.New(slog.NewTextHandler(&logs, nil))})})
	require.NoError(t, err)
	l, err := lim.For("k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.FixedWindow, l.Config().Algorithm)

	_, err = policy.Set(ctx, pool, policy.Policy{Name: "api", Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "api"))
	l, err = lim.For("k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.SlidingWindow, l.Config().Algorithm)
	require.Equal(t, int64(5), l.Config().Limit)
	cur, err := lim.Policy()
	require.NoError(t, err)
	require.Equal(t, time.Minute, cur.Window)

	// A token bucket of limit 1 per hour cannot hold the override's burst.
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "api", Algorithm: ratelimit.TokenBucket, Limit: 1, Window: time.Hour})
	require.NoError(t, err)
	require.NoError(t, cache.ReloadPolicy(ctx, "api"))
	for range 2 {
		d, err := lim.Allow(ctx, "big")
		require.NoError(t, err)
		require.Equal(t, int64(1), d.Limit)
	}
	require.Equal(t, 1, strings.Count(logs.String(), "ignoring an override"), logs.String())
	x, err := policy.Explain(ctx, pool, "api", "big")
	require.NoError(t, err)
	require.Nil(t, x.Override)
	require.Contains(t, x.Ignored, "1,000 years")
}

// The key mode of a policy with overrides stays: their keys are stored in
// it.
func TestKeyModeChangeWithOverridesRefused(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("k"), Limit: 9})
	require.NoError(t, err)
	p.KeyMode = ratelimit.ReadableKeys
	_, err = policy.Set(ctx, pool, p)
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorContains(t, err, "delete them first")
	got, err := policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, ratelimit.HashedKeys, got.KeyMode)
	p.KeyMode, p.Limit = ratelimit.HashedKeys, 6
	_, err = policy.Set(ctx, pool, p)
	require.NoError(t, err, "other changes go through")
	require.NoError(t, policy.DeleteOverride(ctx, pool, "api", p.StoredKey("k")))
	p.KeyMode = ratelimit.ReadableKeys
	_, err = policy.Set(ctx, pool, p)
	require.NoError(t, err)
}

// Plain SQL meets the same refusal, from the trigger.
func TestKeyModeChangeWithOverridesRefusedInSQL(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 5, Window: time.Minute})
	require.NoError(t, err)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: p.StoredKey("k"), Limit: 9})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET key_mode = 'readable' WHERE name = 'api'`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr))
	require.Equal(t, "pgrl_policy_key_mode_overrides_check", pgErr.ConstraintName)
	require.Equal(t, "23514", pgErr.Code)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "limit" = 6 WHERE name = 'api'`)
	require.NoError(t, err)
}

// Checks that find their policy changed reload it once between them: 64
// concurrent checks after a new window cost one reload query, and each is
// then decided at the new window, exactly.
func TestChangedPolicyReloadedOnce(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "herd", Limit: 40, Window: time.Hour})
	require.NoError(t, err)
	cdb := &testkit.CountingDB{Pool: pool}
	cache := policy.NewCache(cdb)
	require.NoError(t, cache.Reload(ctx))
	// 64 uncoalesced checks of one key count exactly: a loaded machine's
	// late answer must not go to the memory tier (testkit.DecisionTimeout).
	lim, err := newLimiter(ctx, pool, "herd", policy.Options{Cache: cache,
		Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "window" = interval '2 hours' WHERE name = 'herd'`)
	require.NoError(t, err)

	before := cdb.Statements()
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			d, err := lim.Allow(ctx, "k")
			assert.NoError(t, err)
			if d.Allowed {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int64(40), admitted.Load())
	require.Equal(t, int64(1), cdb.Statements()-before, "one reload for all the checks that found the change")
	p, err := lim.Policy()
	require.NoError(t, err)
	require.Equal(t, 2*time.Hour, p.Window)
}

// A policy whose window changes starts afresh, even at an instant where
// the old and the new window end together.
func TestPolicyNewWindowStartsAfresh(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	// At 03:04 the hour [03:00, 04:00) and the two hours [02:00, 04:00)
	// both end at 04:00.
	now := testkit.Pinned(time.Date(2030, 1, 2, 3, 4, 0, 0, time.UTC))
	for _, fromCache := range []bool{false, true} {
		name := fmt.Sprintf("afresh-%v", fromCache)
		_, err := policy.Set(ctx, pool, policy.Policy{Name: name, Limit: 3, Window: time.Hour})
		require.NoError(t, err)
		cache := policy.NewCache(pool)
		require.NoError(t, cache.Reload(ctx))
		lim, err := newLimiter(ctx, pool, name, policy.Options{Cache: cache, FromCache: fromCache,
			Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Now: now})})
		require.NoError(t, err)
		d, err := lim.Allow(ctx, "k", ratelimit.Cost(3))
		require.NoError(t, err)
		require.True(t, d.Allowed)
		_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET "window" = interval '2 hours', "limit" = 5 WHERE name = $1`, name)
		require.NoError(t, err)
		require.NoError(t, cache.ReloadPolicy(ctx, name))
		d, err = lim.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, d.Allowed)
		require.Equal(t, int64(1), d.Used, "FromCache %v: a new window starts afresh", fromCache)
		require.Equal(t, int64(5), d.Limit)
	}
}
