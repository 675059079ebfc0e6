package gen

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
		for _, mode := range planModes {
			lines := explain(t, pool, c, mode, "VERBOSE")
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

// TestPolicyBatchesProbeEachOverride proves that the coalesced statements
// that read stored policies find each key's override by one probe of
// pgrl_policy_override's primary key. Once the table held overrides,
// PostgreSQL planned the first version of them as a hash join of every
// override of the policy, read again for every batch: half the plain
// statement's throughput at 8 callers.
func TestPolicyBatchesProbeEachOverride(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst) VALUES
		('fw', 'fixed_window', 5, interval '5 seconds', NULL),
		('tb', 'token_bucket', 5, interval '5 seconds', 5),
		('sw', 'sliding_window', 5, interval '5 seconds', NULL)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit")
		SELECT p, pgrl_stored_key(p, 'other-' || i), 7 FROM unnest(ARRAY['fw', 'tb', 'sw']) AS p, generate_series(1, 1000) AS i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE pgrl_policy, pgrl_policy_override`)
	require.NoError(t, err)

	var calls []call
	ops, at := sqlops.New(), time.Now()
	keys, costs := [][]byte{[]byte("a"), []byte("b"), []byte("c")}, []int64{1, 1, 1}
	_, _ = ops.FixedWindowTakeManyPolicy(ctx, recorder{&calls}, sqlops.FixedWindowTakeManyPolicyParams{
		Keys: keys, OverrideKeys: keys, Costs: costs, At: &at, WindowUs: 5e6, Policy: "fw", KeyMode: "hashed"})
	_, _ = ops.TokenBucketTakeManyPolicy(ctx, recorder{&calls}, sqlops.TokenBucketTakeManyPolicyParams{
		Keys: keys, OverrideKeys: keys, Costs: costs, At: &at, Policy: "tb", KeyMode: "hashed"})
	_, _ = ops.SlidingWindowTakeManyPolicy(ctx, recorder{&calls}, sqlops.SlidingWindowTakeManyPolicyParams{
		Keys: keys, OverrideKeys: keys, Costs: costs, At: &at, WindowUs: 5e6, Policy: "sw", KeyMode: "hashed"})
	one := []int32{1, 2, 3}
	flags, zeros := []bool{false, false, false}, []int64{0, 0, 0}
	_, _ = ops.FixedWindowTakePolicyChecks(ctx, recorder{&calls}, sqlops.FixedWindowTakePolicyChecksParams{
		Keys: keys, MaxCounts: []int64{5, 5, 5}, WindowsUs: []int64{5e6, 5e6, 5e6}, Penalties: flags, Runs: one,
		Ends: one, Rows: one, Costs: costs, UpTo: flags, Vetoes: []bool{true, true, true}, Mins: zeros, Shares: zeros,
		At: &at, Policies: []string{"fw", "fw", "fw"}, OverrideKeys: keys, KeyModes: []string{"hashed", "hashed", "hashed"}})
	_, _ = ops.TokenBucketTakePolicyChecks(ctx, recorder{&calls}, sqlops.TokenBucketTakePolicyChecksParams{
		Keys: keys, Capacities: []float64{5, 5, 5}, RefillsPerUs: []float64{1e-6, 1e-6, 1e-6}, Penalties: flags,
		Runs: one, Ends: one, Rows: one, Costs: costs, UpTo: flags, Vetoes: []bool{true, true, true}, Mins: zeros,
		Shares: zeros, At: &at, Policies: []string{"tb", "tb", "tb"}, OverrideKeys: keys,
		KeyModes: []string{"hashed", "hashed", "hashed"}})
	_, _ = ops.SlidingWindowTakePolicyChecks(ctx, recorder{&calls}, sqlops.SlidingWindowTakePolicyChecksParams{
		Keys: keys, MaxCounts: []int64{5, 5, 5}, WindowsUs: []int64{5e6, 5e6, 5e6}, Penalties: flags, Runs: one,
		Ends: one, Rows: one, Costs: costs, UpTo: flags, Vetoes: []bool{true, true, true}, Mins: zeros, Shares: zeros,
		At: &at, Policies: []string{"sw", "sw", "sw"}, OverrideKeys: keys, KeyModes: []string{"hashed", "hashed", "hashed"}})
	require.Len(t, calls, 6)

	for _, c := range calls {
		for _, mode := range planModes {
			plan := strings.Join(explain(t, pool, c, mode, "COSTS OFF"), "\n")
			require.Regexp(t, `Index Scan using pgrl_policy_override_pkey on pgrl_policy_override`, plan,
				"%s (%s): each key's override is not a probe of the primary key:\n%s", c.name, mode, plan)
			require.NotRegexp(t, `(Seq|Bitmap Heap) Scan on pgrl_policy_override|Hash.*\n.*pgrl_policy_override`, plan,
				"%s (%s): every override is read:\n%s", c.name, mode, plan)
		}
	}
}

// planModes are the plans a prepared statement may get.
var planModes = []string{"force_custom_plan", "force_generic_plan"}

// explain returns the lines of c's plan under plan_cache_mode mode, with
// EXPLAIN's options opts.
func explain(t *testing.T, pool *pgxpool.Pool, c call, mode, opts string) []string {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode)
	require.NoError(t, err)
	rows, err := tx.Query(ctx, "EXPLAIN ("+opts+") "+c.sql, c.args...)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err, c.name)
	return lines
}
