package gen

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// TestStatementsProbeTheirRows proves that no statement reads a whole
// counter table: with 50,000 rows in each, analyzed, the plan of every
// statement everyQuery sends, custom and generic, scans no counter table
// sequentially. A batch's keys are an array parameter whose length the
// planner does not know (it takes generate_subscripts for 1,000 rows), and
// joined to a counter table by a hash, such an array made a plan that read
// every row of the table on every call. And run as the library runs them
// (prepared, plan_cache_mode auto), each gets its generic plan after its
// first five calls: an estimate taken from an array's contents, which a
// custom plan sees and a generic one does not, makes the generic plan look
// dearer, and PostgreSQL then plans the statement anew on every call.
func TestStatementsProbeTheirRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t, dbtest.WithExecMode(pgx.QueryExecModeCacheStatement))
	_, err := pool.Exec(ctx, `
		INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT int8send(g), now() + interval '1 hour', 1, true FROM generate_series(1, 50000) AS g;
		INSERT INTO pgrl_token_bucket (key, tokens, updated_at, full_at, allowed)
		SELECT int8send(g), 1, now(), now() + interval '1 hour', true FROM generate_series(1, 50000) AS g;
		INSERT INTO pgrl_sliding_window (key, window_start, count, prev_count, expires_at, allowed)
		SELECT int8send(g), now(), 1, 0, now() + interval '1 hour', true FROM generate_series(1, 50000) AS g;
		ANALYZE pgrl_fixed_window, pgrl_token_bucket, pgrl_sliding_window`)
	require.NoError(t, err)
	seq := regexp.MustCompile(`Seq Scan on (pgrl_fixed_window|pgrl_token_bucket|pgrl_sliding_window)\b`)
	calls := everyQueryCalls(ctx, t, pool)
	for _, c := range calls {
		for _, mode := range planModes {
			plan := strings.Join(explain(t, pool, c, mode, "COSTS OFF"), "\n")
			assert.NotRegexp(t, seq, plan, "%s (%s) reads a whole counter table:\n%s", c.name, mode, plan)
		}
	}

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for _, c := range calls {
		for range 8 {
			tx, err := conn.Begin(ctx)
			require.NoError(t, err)
			if rows, err := tx.Query(ctx, c.sql, c.args...); err == nil {
				rows.Close()
			}
			require.NoError(t, tx.Rollback(ctx))
		}
		var generic, custom int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
			WHERE statement = $1`, c.sql).Scan(&generic, &custom), c.name)
		assert.Positive(t, generic, "%s: %d custom plans and no generic plan in 8 calls", c.name, custom)
	}
}
