package main

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
)

// rl-policy run as a role that lacks USAGE on the schema, then SELECT on
// the policy tables, names the grant (exit 1), never that tables are missing.
func TestPermissionNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, s := dbtest.Pool(t)
	_, err := policy.Set(ctx, owner, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	expect := func(what, grant string) {
		t.Helper()
		for _, args := range [][]string{{"list"}, {"get", "api"}} {
			stdout, stderr, code := runFn(t, append([]string{"--database-url", dbtest.URLAs(role), "--schema", s}, args...)...)
			require.Equal(t, cli.ExitError, code, "%s %v: %s%s", what, args, stdout, stderr)
			require.Contains(t, stderr, grant, "%s %v", what, args)
			require.NotContains(t, stderr, "tables are missing", "%s %v", what, args)
		}
	}
	expect("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	_, err = admin.Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	expect("USAGE without SELECT", "GRANT SELECT ON "+schema+`."pgrl_policy", `+schema+`."pgrl_policy_override" TO `+roleID)
}

// rl-policy set as a role that may read the policies only names the grant
// of a write and the migration role.
func TestPermissionWriteNamesTheGrant(t *testing.T) {
	t.Parallel()
	ks := newKeySetup(t)
	_, stderr, code := runFn(t, "--database-url", dbtest.URLAs(ks.app), "--schema", ks.schema, "set", "api", "--limit", "5", "--window", "1m")
	require.Equal(t, cli.ExitError, code, stderr)
	require.Contains(t, stderr, "GRANT INSERT, UPDATE, DELETE ON "+pgx.Identifier{ks.schema}.Sanitize()+`."pgrl_policy"`)
	require.Contains(t, stderr, "TO "+pgx.Identifier{ks.app}.Sanitize())
	require.Contains(t, stderr, "migration role")
}
