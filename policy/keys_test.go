package policy_test

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// requireConstraint asserts that err is PostgreSQL refusing the statement
// by the named constraint, with a hint that names pgrl_policy_key.
func requireConstraint(t *testing.T, err error, constraint string) *pgconn.PgError {
	t.Helper()
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "want a refusal by %s, got %v", constraint, err)
	require.Equal(t, constraint, pgErr.ConstraintName, pgErr.Message)
	require.Equal(t, "23514", pgErr.Code)
	return pgErr
}

// An override written by plain SQL with the caller's key itself, instead of
// its stored form, is refused by the table: it could never apply. The
// recipe of docs/POLICIES.md (pgrl_policy_key) writes a row that the next
// check obeys, for either key mode.
func TestRawKeyOverrideRefused(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "login", Limit: 2, Window: time.Hour, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)

	for _, tc := range []struct{ sql, mode string }{
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', 'tenant-9', 5)`, "hashed"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', pgrl_stored_key('api', 'tenant-9', true), 5)`, "hashed"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('login', 'ada@example.com', 5)`, "readable"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('login', pgrl_stored_key('login', 'ada@example.com'), 5)`, "readable"},
		{`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('login', 'api:ada@example.com', 5)`, "readable"},
	} {
		_, err := pool.Exec(ctx, tc.sql)
		pgErr := requireConstraint(t, err, "pgrl_policy_override_key_mode_check")
		require.Contains(t, pgErr.Message, "whose keys are "+tc.mode, tc.sql)
		require.Contains(t, pgErr.Message, "would never apply", tc.sql)
		require.Contains(t, pgErr.Hint, "pgrl_policy_key(", tc.sql)
	}
	os, err := policy.ListOverrides(ctx, pool, "")
	require.NoError(t, err)
	require.Empty(t, os, "nothing was written")

	// The recipe: the caller's key through pgrl_policy_key.
	for _, name := range []string{"api", "login"} {
		_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit", note)
			VALUES ($1, pgrl_policy_key($1, 'tenant-9'), 5, 'plan B')`, name)
		require.NoError(t, err, name)
		lim, err := newLimiter(ctx, pool, name, policy.Options{})
		require.NoError(t, err)
		for i := 1; i <= 6; i++ {
			d, err := lim.Allow(ctx, "tenant-9")
			require.NoError(t, err)
			require.Equal(t, i <= 5, d.Allowed, "%s: check %d under the override's limit of 5", name, i)
			require.Equal(t, int64(5), d.Limit)
		}
		x, err := policy.Explain(ctx, pool, name, "tenant-9")
		require.NoError(t, err)
		require.NotNil(t, x.Override, name)
		require.Equal(t, "plan B", x.Override.Note)
	}

	// An UPDATE that gives a row a raw key is refused too.
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy_override SET key = 'tenant-10' WHERE policy = 'api'`)
	requireConstraint(t, err, "pgrl_policy_override_key_mode_check")
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy_override SET "limit" = 6 WHERE policy = 'api'`)
	require.NoError(t, err, "other changes of a valid row go through")

	// pgrl_policy_key of a policy that does not exist says to create it.
	_, err = pool.Exec(ctx, `SELECT pgrl_policy_key('missing', 'k')`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr))
	require.Contains(t, pgErr.Message, "no policy is named missing")
	require.Contains(t, pgErr.Hint, "create the policy first")
}

// pgrl_policy_key is Policy.StoredKey: the bytes a check looks up.
func TestPolicyKeyInSQL(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	for _, mode := range []ratelimit.KeyMode{ratelimit.HashedKeys, ratelimit.ReadableKeys} {
		p, err := policy.Set(ctx, pool, policy.Policy{Name: "p-" + hex.EncodeToString([]byte{byte(mode)}), Limit: 1, Window: time.Minute, KeyMode: mode})
		require.NoError(t, err)
		for _, key := range []string{"", "203.0.113.7", "ada@example.com", "é", strings.Repeat("k", 300)} {
			var got []byte
			require.NoError(t, pool.QueryRow(ctx, `SELECT pgrl_policy_key($1, $2)`, p.Name, key).Scan(&got))
			require.Equal(t, hex.EncodeToString(p.StoredKey(key)), hex.EncodeToString(got), "mode %d key %q", mode, key)
		}
	}
}

// SetOverride refuses a key that is not a stored key of the policy's key
// mode, naming the fix, before the database would.
func TestSetOverrideRefusesRawKey(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	hashed, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	readable, err := policy.Set(ctx, pool, policy.Policy{Name: "login", Limit: 2, Window: time.Hour, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)
	for _, o := range []policy.Override{
		{Policy: "api", Key: []byte("tenant-9"), Limit: 5},
		{Policy: "api", Key: readable.StoredKey("tenant-9"), Limit: 5},
		{Policy: "login", Key: []byte("tenant-9"), Limit: 5},
		{Policy: "login", Key: hashed.StoredKey("tenant-9"), Limit: 5},
	} {
		_, err := policy.SetOverride(ctx, pool, o)
		require.ErrorIs(t, err, policy.ErrInvalid, "%q", o.Key)
		require.ErrorContains(t, err, "would never apply")
		require.ErrorContains(t, err, "Policy.StoredKey")
	}
	for _, p := range []policy.Policy{hashed, readable} {
		_, err := policy.SetOverride(ctx, pool, policy.Override{Policy: p.Name, Key: p.StoredKey("tenant-9"), Limit: 5})
		require.NoError(t, err)
	}
}

// A policy's key mode and name stay while it has overrides: their keys are
// stored in that mode, under that name. An override written while the key
// mode changes waits for the change and is checked against the new mode.
func TestPolicyKeyBindingKept(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', pgrl_policy_key('api', 'k'), 5)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET name = 'api2' WHERE name = 'api'`)
	pgErr := requireConstraint(t, err, "pgrl_policy_name_overrides_check")
	require.Contains(t, pgErr.Hint, "create a policy of the new name")
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET key_mode = 'readable' WHERE name = 'api'`)
	requireConstraint(t, err, "pgrl_policy_key_mode_overrides_check")
	_, err = pool.Exec(ctx, `DELETE FROM pgrl_policy_override`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy SET name = 'api2' WHERE name = 'api'`)
	require.NoError(t, err, "a policy without overrides may be renamed")

	// Transaction A changes the key mode; B writes an override in the old
	// mode meanwhile. B waits for A, then is refused.
	a, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = a.Rollback(ctx) }()
	_, err = a.Exec(ctx, `UPDATE pgrl_policy SET key_mode = 'readable' WHERE name = 'api2'`)
	require.NoError(t, err)
	var pid uint32
	bconn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer bconn.Release()
	pid = bconn.Conn().PgConn().PID()
	done := make(chan error, 1)
	go func() {
		_, err := bconn.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api2', pgrl_stored_key('api2', 'k'), 5)`)
		done <- err
	}()
	waited := false
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !waited; {
		select {
		case err := <-done:
			done <- err
			deadline = time.Now()
			continue
		default:
		}
		var w bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&w))
		waited = w
		time.Sleep(10 * time.Millisecond)
	}
	require.True(t, waited, "the override's INSERT waits for the key mode change")
	require.NoError(t, a.Commit(ctx))
	requireConstraint(t, <-done, "pgrl_policy_override_key_mode_check")
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pgrl_policy_override`).Scan(&n))
	require.Zero(t, n)
}

// The key's check, pgrl_policy_key and the policy trigger find pgrl's
// tables from a session whose search_path does not name the schema, as a
// DBA's psql may be.
func TestKeyChecksWithAnotherSearchPath(t *testing.T) {
	t.Parallel()
	pool, s := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	admin := dbtest.Admin(t)
	q := func(sql string) string { return strings.ReplaceAll(sql, "$s.", `"`+s+`".`) }
	_, err = admin.Exec(ctx, q(`INSERT INTO $s.pgrl_policy_override (policy, key, "limit") VALUES ('api', 'tenant-9', 5)`))
	requireConstraint(t, err, "pgrl_policy_override_key_mode_check")
	_, err = admin.Exec(ctx, q(`INSERT INTO $s.pgrl_policy_override (policy, key, "limit") VALUES ('api', $s.pgrl_policy_key('api', 'tenant-9'), 5)`))
	require.NoError(t, err)
	_, err = admin.Exec(ctx, q(`UPDATE $s.pgrl_policy SET key_mode = 'readable' WHERE name = 'api'`))
	requireConstraint(t, err, "pgrl_policy_key_mode_overrides_check")
	x, err := policy.Explain(ctx, pool, "api", "tenant-9")
	require.NoError(t, err)
	require.NotNil(t, x.Override)
}
