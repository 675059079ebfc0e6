package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestPolicyLimiterUnsupported: a policy's limiter whose check the server
// refuses as not supported (SQLSTATE 0A000, raised here by a trigger on the
// counter table, as Citus refuses an upsert it cannot run) returns
// ErrUnsupported under every failure policy, whether the check reads the
// policy in its statement or from the cache: no failure-policy answer, no
// open breaker, and PostgreSQL counts the next check once the table
// accepts writes again.
func TestPolicyLimiterUnsupported(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE FUNCTION refuse_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'functions used in the DO UPDATE SET clause of INSERTs on distributed tables must be marked IMMUTABLE'
    USING ERRCODE = 'feature_not_supported';
END $$;
CREATE TRIGGER refuse_write BEFORE INSERT OR UPDATE ON pgrl_fixed_window FOR EACH ROW EXECUTE FUNCTION refuse_write()`)
	require.NoError(t, err)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var limiters []*policy.Limiter
	for _, onFailure := range []ratelimit.FailurePolicy{ratelimit.FailOpen, ratelimit.FailClosed, ratelimit.FailToMemory} {
		for _, fromCache := range []bool{false, true} {
			name := fmt.Sprintf("p%d-%v", onFailure, fromCache)
			_, err := policy.Set(ctx, pool, policy.Policy{Name: name, Limit: 5, Window: time.Hour})
			require.NoError(t, err)
			rdb := testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Logger: quiet, Timeout: time.Minute})
			lim, err := newLimiter(ctx, pool, name, policy.Options{FromCache: fromCache,
				Config: ratelimit.Config{OnFailure: onFailure}, Database: rdb})
			require.NoError(t, err)
			l, err := lim.For("k")
			require.NoError(t, err)
			for range 3 * rdb.Options().BreakerThreshold {
				d, err := lim.Allow(ctx, "k")
				require.ErrorIs(t, err, ratelimit.ErrUnsupported, "%s: decision %+v", name, d)
				var pgErr *pgconn.PgError
				require.ErrorAs(t, err, &pgErr, name)
				require.Equal(t, "0A000", pgErr.Code, name)
				require.Empty(t, d.Store, "%s: no store answered", name)
			}
			require.False(t, l.BreakerOpen(), name)
			limiters = append(limiters, lim)
		}
	}
	_, err = pool.Exec(ctx, `DROP TRIGGER refuse_write ON pgrl_fixed_window`)
	require.NoError(t, err)
	for _, lim := range limiters {
		d, err := lim.Allow(ctx, "k")
		require.NoError(t, err, lim.Name())
		require.Equal(t, ratelimit.StorePostgres, d.Store, lim.Name())
		require.Equal(t, int64(1), d.Used, "%s: counted, and nothing before", lim.Name())
	}
}
