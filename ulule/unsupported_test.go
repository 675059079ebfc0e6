package ulule_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"github.com/ulule/limiter/v3/drivers/store/memory"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ulule"
)

// TestUnsupportedIsNotAnOutage: SQL the server refuses as not supported
// (SQLSTATE 0A000, what Citus answers for an upsert it cannot run; raised
// here by a trigger on the counter table) is ErrUnsupported under every
// failure policy, logged once, and the fallback store counts nothing.
func TestUnsupportedIsNotAnOutage(t *testing.T) {
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
	for _, policy := range []ulule.FailurePolicy{ulule.FailOpen, ulule.FailClosed, ulule.FailToStore} {
		logs := &testkit.LogBuffer{}
		fallback := memory.NewStore()
		s, err := ulule.NewStoreWithOptions(pool, ulule.Options{OnFailure: policy, Fallback: fallback,
			Logger: slog.New(slog.NewTextHandler(logs, nil))})
		require.NoError(t, err)
		for range 5 {
			_, err := s.Get(ctx, "k", minute3)
			require.ErrorIs(t, err, ulule.ErrUnsupported, policy)
			var pgErr *pgconn.PgError
			require.True(t, errors.As(err, &pgErr), policy)
			require.Equal(t, "0A000", pgErr.Code)
		}
		require.Equal(t, 1, strings.Count(logs.String(), "level=ERROR"), "%s:\n%s", policy, logs.String())
		require.NotContains(t, logs.String(), "failure policy answers\"", policy)
		lc, err := fallback.Peek(ctx, "k", minute3)
		require.NoError(t, err)
		require.Equal(t, minute3.Limit, lc.Remaining, "%s: the fallback store counted", policy)
	}
}
