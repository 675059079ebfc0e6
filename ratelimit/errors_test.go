package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestMapErrSQLStates: every SQLSTATE a check interprets becomes its
// typed error, which IsConfigError reports, with the *pgconn.PgError kept
// for errors.As; any other is an outage, which it does not.
func TestMapErrSQLStates(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		code, msg string
		want      error // nil: an outage
	}{
		{"42P01", `relation "pgrl_fixed_window" does not exist`, ratelimit.ErrNotMigrated},
		{"3F000", `schema "app" does not exist`, ratelimit.ErrNotMigrated},
		{"42883", "function pgrl_fixed_window_take(bytea) does not exist", ratelimit.ErrNotMigrated},
		{"42501", "permission denied for table pgrl_fixed_window", ratelimit.ErrPermission},
		{"25006", "cannot execute INSERT in a read-only transaction", ratelimit.ErrReadOnly},
		{"0A000", "cannot execute INSERT during recovery", ratelimit.ErrReadOnly},
		{"23514", `no partition of relation "pgrl_fixed_window" found for row`, ratelimit.ErrNoPartition},
		{"22008", "timestamp out of range", ratelimit.ErrInvalidInput},
		{"23505", "duplicate key value", ratelimit.ErrInvalidInput},
		{"54000", "index row size exceeds maximum", ratelimit.ErrInvalidInput},
		{"0A000", "DETACH CONCURRENTLY is not supported", ratelimit.ErrUnsupported},
		{"42804", "datatype mismatch", ratelimit.ErrUnsupported},
		{"0A000", "cached plan must not change result type", nil},
		{"55P03", "canceling statement due to lock timeout", nil},
		{"57014", "canceling statement due to statement timeout", nil},
		{"40001", "could not serialize access", nil},
		{"08006", "connection failure", nil},
		{"57P01", "terminating connection due to administrator command", nil},
	} {
		pgErr := &pgconn.PgError{Code: c.code, Message: c.msg}
		err := ratelimit.MapErr(fmt.Errorf("take: %w", pgErr))
		if c.want != nil {
			require.ErrorIs(t, err, c.want, "%s %s", c.code, c.msg)
		}
		require.Equal(t, c.want != nil, ratelimit.IsConfigError(err), "%s %s: %v", c.code, c.msg, err)
		var got *pgconn.PgError
		require.ErrorAs(t, err, &got)
		require.Same(t, pgErr, got)
	}
}

// TestIsConfigError: the errors a caller must fix, wrapped or not, and
// none of the others.
func TestIsConfigError(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		ratelimit.ErrNotMigrated, ratelimit.ErrReadOnly, ratelimit.ErrNoPartition, ratelimit.ErrPermission,
		ratelimit.ErrUnsupported, ratelimit.ErrPolicyChanged, ratelimit.ErrInvalidInput, ratelimit.ErrKeyTooLong,
		ratelimit.ErrInvalidCost, ratelimit.ErrCostExceedsLimit, ratelimit.ErrNilDB, ratelimit.ErrNilLimiter,
		ratelimit.ErrEmptyMulti, ratelimit.ErrDuplicateCheck, ratelimit.ErrMixedDatabases, ratelimit.ErrInvalidMultiMode,
		ratelimit.ErrInvalidName, ratelimit.ErrInvalidAlgorithm, ratelimit.ErrInvalidLimit, ratelimit.ErrInvalidWindow,
		ratelimit.ErrInvalidBurst, ratelimit.ErrInvalidPolicy, ratelimit.ErrInvalidTimeout, ratelimit.ErrInvalidOption,
	} {
		require.True(t, ratelimit.IsConfigError(err), "%v", err)
		require.True(t, ratelimit.IsConfigError(fmt.Errorf("wrapped: %w", err)), "%v", err)
	}
	for _, err := range []error{
		nil, errors.New("dial tcp: connection refused"), context.Canceled, context.DeadlineExceeded,
		ratelimit.ErrPartitionMissing, &pgconn.PgError{Code: "42P01"}, // not mapped: a check never returns it bare
	} {
		require.False(t, ratelimit.IsConfigError(err), "%v", err)
	}
}

// TestIsConfigErrorFromChecks: what real checks return. A schema without
// pgrl's tables and a clock outside PostgreSQL's range are the caller's to
// fix, whatever the failure policy; an unreachable server is not.
func TestIsConfigErrorFromChecks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// A check that outlasted the Timeout would be answered by FailOpen: the
	// tests' Timeout keeps a busy machine from turning an error into that.
	cfg := ratelimit.Config{Name: "config", Algorithm: ratelimit.FixedWindow, Limit: 10, Window: time.Minute,
		OnFailure: ratelimit.FailOpen}
	opts := ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}

	empty := dbtest.PoolOn(t, dbtest.NewSchema(t))
	l, err := testkit.New(empty, cfg, opts)
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrNotMigrated)
	require.True(t, ratelimit.IsConfigError(err), "%v", err)

	pool, _ := dbtest.Pool(t)
	far := opts
	far.Now = func() time.Time { return time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }
	l, err = testkit.New(pool, cfg, far)
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.ErrorIs(t, err, ratelimit.ErrInvalidInput)
	require.True(t, ratelimit.IsConfigError(err), "%v", err)

	_, err = l.Allow(ctx, "k", ratelimit.Cost(0))
	require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	require.True(t, ratelimit.IsConfigError(err), "%v", err)

	down, err := pgxpool.New(ctx, "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(down.Close)
	outage := cfg
	outage.OnFailure = ratelimit.FailError
	l, err = testkit.New(down, outage, ratelimit.DatabaseOptions{Timeout: time.Second})
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.Error(t, err)
	require.False(t, ratelimit.IsConfigError(err), "%v", err)
}

// TestOneErrPermission: the ErrPermission of every package is one value, so
// errors.Is matches whichever a caller tests against.
func TestOneErrPermission(t *testing.T) {
	t.Parallel()
	for name, err := range map[string]error{
		"policy": policy.ErrPermission, "cleanup": cleanup.ErrPermission, "migration": migration.ErrPermission,
	} {
		require.True(t, err == ratelimit.ErrPermission, name) // the same value, not only a match
	}
}
