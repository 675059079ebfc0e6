package gen

import (
	"context"
	"regexp"
	"strings"
	"testing"

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
// every row of the table on every call.
func TestStatementsProbeTheirRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
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
}
