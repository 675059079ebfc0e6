package pgerr_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/pgerr"
)

// predicates are the SQLSTATE predicates of package pgerr, by name.
var predicates = map[string]func(error) bool{
	"IsLockTimeout":         pgerr.IsLockTimeout,
	"IsQueryCanceled":       pgerr.IsQueryCanceled,
	"IsDeadlock":            pgerr.IsDeadlock,
	"IsAuthFailure":         pgerr.IsAuthFailure,
	"IsMissingDatabase":     pgerr.IsMissingDatabase,
	"IsMissingFunction":     pgerr.IsMissingFunction,
	"IsForeignKeyViolation": pgerr.IsForeignKeyViolation,
	"IsConstraintViolation": pgerr.IsConstraintViolation,
	"IsTooManyPartitions":   pgerr.IsTooManyPartitions,
	"IsPendingDetach":       pgerr.IsPendingDetach,
}

// TestSQLStates is the whole mapping: every SQLSTATE pgrl reads, the Kind
// Classify gives it and the predicates that hold for it (all others must
// not).
func TestSQLStates(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		code, msg, hint string
		kind            pgerr.Kind
		holds           []string
	}{
		// Undefined.
		{code: "42P01", msg: `relation "pgrl_fixed_window" does not exist`, kind: pgerr.Undefined},
		{code: "3F000", msg: `schema "app" does not exist`, kind: pgerr.Undefined},
		{code: "42883", msg: "function pgrl_fixed_window_take_many(bytea[]) does not exist", kind: pgerr.Undefined,
			holds: []string{"IsMissingFunction"}},
		// Permission.
		{code: "42501", msg: "permission denied for table pgrl_fixed_window", kind: pgerr.Permission},
		// ReadOnly.
		{code: "25006", msg: "cannot execute INSERT in a read-only transaction", kind: pgerr.ReadOnly},
		{code: "0A000", msg: "cannot execute INSERT during recovery", kind: pgerr.ReadOnly},
		// NoPartition.
		{code: "23514", msg: `no partition of relation "pgrl_fixed_window" found for row`, kind: pgerr.NoPartition,
			holds: []string{"IsConstraintViolation"}},
		// Input: classes 22, 23 and 54.
		{code: "22008", msg: "timestamp out of range", kind: pgerr.Input},
		{code: "22003", msg: "bigint out of range", kind: pgerr.Input},
		{code: "22023", msg: "pgrl: partitions of 00:01:00 would need 90 partitions", kind: pgerr.Input,
			holds: []string{"IsTooManyPartitions"}},
		{code: "22023", msg: "pgrl: lookahead -00:01:00 is negative", kind: pgerr.Input},
		{code: "23514", msg: "new row violates check constraint", kind: pgerr.Input, holds: []string{"IsConstraintViolation"}},
		{code: "23503", msg: "violates foreign key constraint", kind: pgerr.Input,
			holds: []string{"IsConstraintViolation", "IsForeignKeyViolation"}},
		{code: "23505", msg: "duplicate key value", kind: pgerr.Input, holds: []string{"IsConstraintViolation"}},
		{code: "54000", msg: "index row size exceeds maximum", kind: pgerr.Input},
		// Unsupported: classes 0A and 42.
		{code: "0A000", msg: "DETACH CONCURRENTLY is not supported", kind: pgerr.Unsupported},
		{code: "0AP01", msg: "a feature of a newer server", kind: pgerr.Unsupported},
		{code: "42883", msg: "operator does not exist: unknown - unknown", kind: pgerr.Unsupported},
		{code: "42601", msg: `syntax error at or near "MERGE"`, kind: pgerr.Unsupported},
		// Other, some of them named by a predicate.
		{code: "0A000", msg: "cached plan must not change result type", kind: pgerr.Other},
		{code: "55P03", msg: "canceling statement due to lock timeout", kind: pgerr.Other, holds: []string{"IsLockTimeout"}},
		{code: "57014", msg: "canceling statement due to statement timeout", kind: pgerr.Other, holds: []string{"IsQueryCanceled"}},
		{code: "40P01", msg: "deadlock detected", kind: pgerr.Other, holds: []string{"IsDeadlock"}},
		{code: "28P01", msg: `password authentication failed for user "web"`, kind: pgerr.Other, holds: []string{"IsAuthFailure"}},
		{code: "28000", msg: `no pg_hba.conf entry for host`, kind: pgerr.Other, holds: []string{"IsAuthFailure"}},
		{code: "3D000", msg: `database "pgrl" does not exist`, kind: pgerr.Other, holds: []string{"IsMissingDatabase"}},
		{code: "55000", msg: `partition "p" already pending detach in partitioned table "public.pgrl_fixed_window"`,
			hint: "Use ALTER TABLE ... DETACH PARTITION ... FINALIZE to complete the pending detach operation.",
			kind: pgerr.Other, holds: []string{"IsPendingDetach"}},
		{code: "40001", msg: "could not serialize access", kind: pgerr.Other},
		{code: "08006", msg: "connection failure", kind: pgerr.Other},
	} {
		pgErr := &pgconn.PgError{Code: c.code, Message: c.msg, Hint: c.hint}
		err := fmt.Errorf("wrapped: %w", pgErr)
		kind, got := pgerr.Classify(err)
		require.Equal(t, c.kind, kind, "%s %s", c.code, c.msg)
		require.Same(t, pgErr, got)
		for name, is := range predicates {
			require.Equal(t, slices.Contains(c.holds, name), is(err), "%s of %s %s", name, c.code, c.msg)
		}
	}
	// An error without a *pgconn.PgError is Other, and no predicate holds.
	for _, err := range []error{context.Canceled, context.DeadlineExceeded, fmt.Errorf("dial: %w", context.Canceled), nil} {
		kind, got := pgerr.Classify(err)
		require.Equal(t, pgerr.Other, kind)
		require.Nil(t, got)
		for name, is := range predicates {
			require.False(t, is(err), "%s of %v", name, err)
		}
	}
}
