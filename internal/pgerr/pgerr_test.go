package pgerr_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		code, msg string
		want      pgerr.Kind
	}{
		{"42P01", `relation "pgrl_policy" does not exist`, pgerr.Undefined},
		{"3F000", `schema "x" does not exist`, pgerr.Undefined},
		{"42883", "function pgrl_fixed_window_take(bigint) does not exist", pgerr.Undefined},
		{"42883", "operator does not exist: unknown - unknown", pgerr.Unsupported},
		{"42883", "function jsonb_path_query_first(jsonb, text) does not exist", pgerr.Unsupported},
		{"42725", "operator is not unique: bigint + unknown", pgerr.Unsupported},
		{"42804", `column "expires_at" is of type timestamp with time zone but expression is of type bigint`, pgerr.Unsupported},
		{"42809", `"pgrl_fixed_window" is not a view`, pgerr.Unsupported},
		{"42601", `syntax error at or near "MERGE"`, pgerr.Unsupported},
		{"42501", "permission denied for table pgrl_policy", pgerr.Permission},
		{"25006", "cannot execute INSERT in a read-only transaction", pgerr.ReadOnly},
		{"0A000", "cannot execute INSERT during recovery", pgerr.ReadOnly},
		{"0A000", "DETACH CONCURRENTLY is not supported", pgerr.Unsupported},
		{"0A000", "functions used in the DO UPDATE SET clause of INSERTs on distributed tables must be marked IMMUTABLE", pgerr.Unsupported},
		{"0AP01", "a feature of a newer server", pgerr.Unsupported},
		{"0A000", "cached plan must not change result type", pgerr.Other},
		{"23514", "no partition of relation \"pgrl_fixed_window\" found for row", pgerr.NoPartition},
		{"23514", "new row violates check constraint", pgerr.Input},
		{"22008", "timestamp out of range", pgerr.Input},
		{"54000", "index row size exceeds maximum", pgerr.Input},
		{"23505", "duplicate key value", pgerr.Input},
		{"57014", "canceling statement due to statement timeout", pgerr.Other},
		{"55P03", "canceling statement due to lock timeout", pgerr.Other},
		{"40001", "could not serialize access", pgerr.Other},
	} {
		pgErr := &pgconn.PgError{Code: c.code, Message: c.msg}
		kind, got := pgerr.Classify(fmt.Errorf("wrapped: %w", pgErr))
		require.Equal(t, c.want, kind, "%s %s", c.code, c.msg)
		require.Same(t, pgErr, got)
	}
	kind, got := pgerr.Classify(context.Canceled)
	require.Equal(t, pgerr.Other, kind)
	require.Nil(t, got)

	require.True(t, pgerr.IsLockTimeout(fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "55P03"})))
	require.False(t, pgerr.IsLockTimeout(&pgconn.PgError{Code: "57014"}))
	require.False(t, pgerr.IsLockTimeout(context.DeadlineExceeded))
}

// Without a catalog to ask, a 42501 is explained from its message.
func TestDenied(t *testing.T) {
	t.Parallel()
	need := pgerr.Need{Tables: []string{"pgrl_policy"}, Privileges: []string{"SELECT"}}
	for msg, want := range map[string]string{
		"permission denied for table pgrl_policy":          `lacks a privilege on pgrl_policy; run GRANT SELECT ON "pgrl_policy" TO <role>`,
		"permission denied for schema app":                 `lacks USAGE on schema app; run GRANT USAGE ON SCHEMA "app" TO <role>`,
		"permission denied for function pgrl_abort_unless": "lacks EXECUTE on function pgrl_abort_unless; run GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA <schema> TO <role>",
		"must be owner of table pgrl_fixed_window":         "lacks ownership of table pgrl_fixed_window; run it as the owner of pgrl's tables",
	} {
		pgErr := &pgconn.PgError{Code: "42501", Message: msg}
		err := pgerr.Denied(pgErr, need)
		require.ErrorIs(t, err, pgerr.ErrPermission, msg)
		require.ErrorIs(t, err, pgErr, msg)
		require.Contains(t, err.Error(), want, msg)
	}
}

// Diagnose finds the schema of the search_path that holds the tables, even
// with a name that needs quoting and another schema holding them too, and
// names the grants with identifiers quoted; truly missing tables are not a
// permission problem.
func TestDiagnoseQuotedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := dbtest.Admin(t)
	base := dbtest.NewSchema(t)
	// The decoy sorts first by name, and the role lacks USAGE on it too.
	odd, decoy := base+` Odd "x", y`, "pgrl_a"+strings.TrimPrefix(base, "pgrl_test")
	for _, s := range []string{odd, decoy} {
		id := pgx.Identifier{s}.Sanitize()
		_, err := admin.Exec(ctx, "CREATE SCHEMA "+id+"; CREATE TABLE "+id+".pgrl_policy (n int); CREATE TABLE "+id+".pgrl_policy_override (n int)")
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP SCHEMA "+id+" CASCADE") })
	}
	role := dbtest.NewRole(t)
	cfg, err := pgx.ParseConfig(dbtest.URLAs(role))
	require.NoError(t, err)
	cfg.RuntimeParams["search_path"] = ` "$user" ,  ` + pgx.Identifier{odd}.Sanitize() + ` , public `
	cfg.RuntimeParams["standard_conforming_strings"] = "off"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })

	pe := pgerr.Diagnose(ctx, conn, pgerr.PolicyRead, notmigrated.Err)
	require.NotNil(t, pe)
	oddID, roleID := pgx.Identifier{odd}.Sanitize(), pgx.Identifier{role}.Sanitize()
	require.Equal(t, role, pe.Role)
	require.Equal(t, []string{
		"GRANT USAGE ON SCHEMA " + oddID + " TO " + roleID,
		"GRANT SELECT ON " + oddID + `."pgrl_policy", ` + oddID + `."pgrl_policy_override" TO ` + roleID,
	}, pe.Grants)
	require.NotErrorIs(t, pe, notmigrated.Err)

	// An unquoted name in search_path is folded to lower case.
	_, err = admin.Exec(ctx, "CREATE TABLE "+pgx.Identifier{base}.Sanitize()+".pgrl_policy (n int)")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "SELECT set_config('search_path', $1, false)", strings.ToUpper(base)+", "+pgx.Identifier{odd}.Sanitize())
	require.NoError(t, err)
	pe = pgerr.Diagnose(ctx, conn, pgerr.PolicyRead, notmigrated.Err)
	require.NotNil(t, pe)
	require.Equal(t, "GRANT USAGE ON SCHEMA "+pgx.Identifier{base}.Sanitize()+" TO "+roleID, pe.Grants[0])
	// A schema outside search_path hides nothing: the tables are missing
	// from the path, which no grant changes.
	_, err = conn.Exec(ctx, "SELECT set_config('search_path', 'public', false)")
	require.NoError(t, err)
	require.Nil(t, pgerr.Diagnose(ctx, conn, pgerr.PolicyRead, notmigrated.Err))
	_, err = conn.Exec(ctx, "SELECT set_config('search_path', $1, false)", pgx.Identifier{odd}.Sanitize())
	require.NoError(t, err)

	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+oddID+" TO "+roleID+"; GRANT SELECT ON ALL TABLES IN SCHEMA "+oddID+" TO "+roleID)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "SELECT * FROM pgrl_policy_missing")
	require.Nil(t, pgerr.Diagnose(ctx, conn, pgerr.PolicyRead, err), "the role lacks nothing: the table is missing")
	_, err = conn.Exec(ctx, "SELECT * FROM pgrl_policy, pgrl_policy_override")
	require.NoError(t, err)
}

// A 42501 on a table the need does not list is looked up too: the grant
// names it, with the role and the schema.
func TestDiagnoseDeniedTableOutsideNeed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, s := dbtest.Pool(t)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	_, err := admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID+"; GRANT SELECT, INSERT, UPDATE, DELETE ON "+
		schema+".pgrl_fixed_window TO "+roleID)
	require.NoError(t, err)
	conn, err := pgx.Connect(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "SELECT 1 FROM pgrl_fixed_window, pgrl_token_bucket")
	need := pgerr.Need{Tables: []string{"pgrl_fixed_window"}, Privileges: []string{"SELECT", "INSERT", "UPDATE", "DELETE"}}
	pe := pgerr.Diagnose(ctx, conn, need, err)
	require.NotNil(t, pe)
	require.Equal(t, []string{"GRANT SELECT, INSERT, UPDATE, DELETE ON " + schema + `."pgrl_token_bucket" TO ` + roleID}, pe.Grants)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, pe, &pgErr)
	require.Equal(t, "42501", pgErr.Code)
}
