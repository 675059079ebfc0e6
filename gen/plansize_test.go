package gen

import (
	"context"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// planNodes counts the expression nodes of one statement's generic plan:
// operators, function calls, and the rest (CASE, least/greatest, coalesce,
// AND/OR/NOT, field reads). The executor builds every one of them again
// each time a cached plan runs, so their number is most of what a check
// costs the server besides the row itself, and unlike a timing it does not
// depend on how busy the machine is.
type planNodes struct{ ops, funcs, other int }

func (n planNodes) total() int { return n.ops + n.funcs + n.other }

// planNode matches one expression node in a plan printed by
// debug_print_plan (debug_pretty_print off).
var planNode = regexp.MustCompile(`\{(OPEXPR|FUNCEXPR|CASEEXPR|MINMAXEXPR|COALESCEEXPR|BOOLEXPR|FIELDSELECT|NULLTEST|` +
	`SCALARARRAYOPEXPR|ROWEXPR|RELABELTYPE|COERCEVIAIO) `)

// countPlanNodes counts the expression nodes of a printed plan.
func countPlanNodes(plan string) planNodes {
	var n planNodes
	for _, m := range planNode.FindAllStringSubmatch(plan, -1) {
		switch m[1] {
		case "OPEXPR":
			n.ops++
		case "FUNCEXPR":
			n.funcs++
		default:
			n.other++
		}
	}
	return n
}

// planNodeBounds are the most expression nodes each take statement's
// generic plan may hold, about a tenth above what PostgreSQL 15 counts
// (versions differ by a few nodes). Migration 000012's steps, which named
// the refilled balance and the rolled-forward counts in every branch, put
// the token bucket's takes at 400 to 465 nodes and the sliding window's at
// 330 to 390; before those steps the single takes held about 90 and 110
// (without leases).
var planNodeBounds = map[string]int{
	"FixedWindowTake":              70,
	"FixedWindowTakeMany":          80,
	"FixedWindowTakeUnderPolicy":   85,
	"TokenBucketTake":              290,
	"TokenBucketTakeMany":          275,
	"TokenBucketTakePolicy":        320,
	"TokenBucketTakeUnderPolicy":   305,
	"TokenBucketTakeRuns":          125,
	"SlidingWindowTake":            285,
	"SlidingWindowTakeMany":        295,
	"SlidingWindowTakeUnderPolicy": 300,
	"SlidingWindowTakeRuns":        160,
}

// TestPlanSizes bounds the size of each algorithm's take statements, as
// generic plans (the plans a prepared statement runs after its first five
// executions), counted in the plan the server prints with debug_print_plan.
// The bounds are what one step per algorithm costs when the statement
// computes each intermediate value (the refilled balance, the rolled-forward
// counts) as few times as the upsert allows; a statement that spells a step
// out once per column it sets, or a step that repeats its refill in every
// branch, grows past them.
func TestPlanSizes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var mu sync.Mutex
	var printed []string
	pool, _ := dbtest.Pool(t, dbtest.WithExecMode(pgx.QueryExecModeCacheStatement), dbtest.WithMaxConns(1),
		func(cfg *pgxpool.Config) {
			cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
				if n.Severity == "LOG" && strings.HasPrefix(n.Message, "plan:") {
					mu.Lock()
					printed = append(printed, n.Detail+n.Message)
					mu.Unlock()
				}
			}
		})
	calls := everyQueryCalls(ctx, t, pool)
	sizes := map[string]planNodes{}
	for _, c := range calls[:len(calls)/2] {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		for _, set := range []string{"plan_cache_mode = force_generic_plan", "debug_pretty_print = off",
			"client_min_messages = log", "debug_print_plan = on"} {
			_, err = tx.Exec(ctx, "SET LOCAL "+set)
			require.NoError(t, err)
		}
		mu.Lock()
		printed = nil
		mu.Unlock()
		rows, err := tx.Query(ctx, c.sql, c.args...)
		require.NoError(t, err, c.name)
		rows.Close()
		require.NoError(t, rows.Err(), c.name)
		require.NoError(t, tx.Rollback(ctx))

		mu.Lock()
		var plan string
		for _, p := range printed {
			if strings.Contains(p, "PLANNEDSTMT") {
				plan = p
			}
		}
		mu.Unlock()
		require.NotEmpty(t, plan, "%s: the server printed no plan", c.name)
		sizes[c.name] = countPlanNodes(plan)
	}
	for name, most := range planNodeBounds {
		n, ok := sizes[name]
		require.True(t, ok, "%s: no such statement in everyQuery", name)
		assert.LessOrEqual(t, n.total(), most, "%s: %d expression nodes in its generic plan (%d operators, %d "+
			"functions, %d others), more than %d", name, n.total(), n.ops, n.funcs, n.other, most)
	}
	names := make([]string, 0, len(sizes))
	for name := range sizes {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		n := sizes[name]
		t.Logf("%-34s operators %4d  functions %4d  other %3d  total %4d", name, n.ops, n.funcs, n.other, n.total())
	}
}
