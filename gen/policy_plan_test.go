package gen

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// TestPolicyFiguresReadOnce proves that each statement that reads its
// stored policy computes the policy's figures once, in a subquery of their
// own (the Insert's input is "Subquery Scan on f"), and that the rest of the
// statement uses them as plain columns: no column of pgrl_policy or
// pgrl_policy_override appears in the output of that scan. Pulled up into
// the outer query, the figures' expressions were copied into each inlined
// call of the step, and evaluated again for each (the token bucket's
// statement ran about a quarter slower than its plain twin).
func TestPolicyFiguresReadOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst) VALUES
		('fw', 'fixed_window', 5, interval '5 seconds', NULL),
		('tb', 'token_bucket', 5, interval '5 seconds', 5),
		('sw', 'sliding_window', 5, interval '5 seconds', NULL)`)
	require.NoError(t, err)

	var calls []call
	ops, at, key := sqlops.New(), time.Now(), []byte("k")
	_, _ = ops.FixedWindowTakePolicy(ctx, recorder{&calls}, sqlops.FixedWindowTakePolicyParams{
		Key: key, Cost: 1, At: &at, WindowUs: 5e6, OverrideKey: key, Policy: "fw", KeyMode: "hashed"})
	_, _ = ops.TokenBucketTakePolicy(ctx, recorder{&calls}, sqlops.TokenBucketTakePolicyParams{
		Key: key, Cost: 1, At: &at, OverrideKey: key, Policy: "tb", KeyMode: "hashed"})
	_, _ = ops.SlidingWindowTakePolicy(ctx, recorder{&calls}, sqlops.SlidingWindowTakePolicyParams{
		Key: key, Cost: 1, At: &at, WindowUs: 5e6, OverrideKey: key, Policy: "sw", KeyMode: "hashed"})
	require.Len(t, calls, 3)

	stored := regexp.MustCompile(`\b[po]\.("limit"|"window"|burst|penalty)`)
	for _, c := range calls {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode)
			require.NoError(t, err)
			rows, err := tx.Query(ctx, "EXPLAIN (VERBOSE) "+c.sql, c.args...)
			require.NoError(t, err)
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err, c.name)
			require.NoError(t, tx.Rollback(ctx))

			plan := strings.Join(lines, "\n")
			scan := -1
			for i, l := range lines {
				if strings.Contains(l, "Subquery Scan on f") {
					scan = i
					break
				}
			}
			require.NotEqual(t, -1, scan, "%s (%s): the figures are not a subquery of their own:\n%s", c.name, mode, plan)
			require.Contains(t, lines[scan+1], "Output:", "%s (%s):\n%s", c.name, mode, plan)
			require.NotRegexp(t, stored, lines[scan+1],
				"%s (%s): the stored figures are evaluated again above their subquery:\n%s", c.name, mode, plan)
			// Above the scan, only the Insert itself.
			for _, l := range lines[:scan] {
				require.NotRegexp(t, stored, l, "%s (%s):\n%s", c.name, mode, plan)
			}
		}
	}
}
