package ulule_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/ulule/limiter/v3/drivers/store/memory"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
	"github.com/pgrl/pgrl/ulule"
)

// A role that lacks USAGE on pgrl's schema, then the table rights, gets
// ErrPermission naming the grant, whatever the failure policy: never
// ErrNotMigrated, never an answer of the policy.
func TestPermissionNamesTheGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, s := dbtest.Pool(t)
	role := dbtest.NewRole(t)
	app, err := pgxpool.New(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(app.Close)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	expect := func(what, grant string) {
		t.Helper()
		for _, opts := range []ulule.Options{{OnFailure: ulule.FailOpen}, {OnFailure: ulule.FailClosed},
			{OnFailure: ulule.FailToStore, Fallback: memory.NewStore()}} {
			st, err := ulule.NewStoreWithOptions(app, opts)
			require.NoError(t, err)
			_, err = st.Get(ctx, "k", minute3)
			_, perr := st.Peek(ctx, "k", minute3)
			_, rerr := st.Reset(ctx, "k", minute3)
			for _, err := range []error{err, perr, rerr} {
				require.ErrorIs(t, err, ulule.ErrPermission, "%s %s", what, opts.OnFailure)
				require.ErrorIs(t, err, ratelimit.ErrPermission, what)
				require.NotErrorIs(t, err, ulule.ErrNotMigrated, what)
				require.Contains(t, err.Error(), grant, what)
				var pgErr *pgconn.PgError
				require.ErrorAs(t, err, &pgErr, what)
			}
		}
	}
	expect("LOGIN only", "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	_, err = dbtest.Admin(t).Exec(ctx, "GRANT USAGE ON SCHEMA "+schema+" TO "+roleID)
	require.NoError(t, err)
	expect("USAGE only", "GRANT SELECT, INSERT, UPDATE, DELETE ON "+schema+`."pgrl_fixed_window" TO `+roleID)
}
