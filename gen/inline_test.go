package gen

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/sql/schema"
)

// helperMigrations are the migrations that add the inlinable helpers: the
// named arithmetic (000005), each algorithm's step (000012) and the token
// bucket's lease helpers (000016).
var helperMigrations = []string{"000005_named_arithmetic.up.sql", "000012_algorithm_steps.up.sql",
	"000016_token_bucket_leases.up.sql", "000022_smaller_steps.up.sql"}

// helperNames lists the LANGUAGE sql functions helperMigrations create,
// read from the files themselves so that a helper added there is checked
// here too.
func helperNames(t *testing.T) []string {
	t.Helper()
	var names []string
	for _, file := range helperMigrations {
		b, err := schema.FS.ReadFile(file)
		require.NoError(t, err)
		for _, m := range regexp.MustCompile(`(?m)^CREATE FUNCTION (\w+)\([^$]*?LANGUAGE sql`).FindAllStringSubmatch(string(b), -1) {
			names = append(names, m[1])
		}
	}
	require.GreaterOrEqual(t, len(names), 25, "helpers not found in %v", helperMigrations)
	return names
}

// call is one statement a generated method sent.
type call struct {
	name string
	sql  string
	args []any
}

var errRecorded = errors.New("recorded, not run")

// recorder is a DBTX that records the statement a generated method sends
// instead of running it.
type recorder struct{ calls *[]call }

func (r recorder) add(sql string, args []any) {
	name := strings.TrimPrefix(strings.SplitN(sql, "\n", 2)[0], "-- name: ")
	*r.calls = append(*r.calls, call{name: strings.Fields(name)[0], sql: sql, args: args})
}

func (r recorder) Exec(_ context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	r.add(sql, args)
	return pgconn.CommandTag{}, errRecorded
}

func (r recorder) Query(_ context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	r.add(sql, args)
	return nil, errRecorded
}

func (r recorder) QueryRow(_ context.Context, sql string, args ...interface{}) pgx.Row {
	r.add(sql, args)
	return errRow{}
}

type errRow struct{}

func (errRow) Scan(...any) error { return errRecorded }

// everyQuery sends every query that computes with the helpers (each
// algorithm's take, batch take and peek, the token bucket's take of a
// stored policy (policy "tb", which TestHelpersAreInlined stores), a lease's
// slice (with a plain check after it, in the token bucket's check
// statement) and its return, the run statements, and the internal query
// that computes a fixed window) to db, twice: the second take of a key runs the UPDATE arm of its
// upsert. The check statement and the return are PL/pgSQL functions: the
// helpers must be inlined into their expressions.
func everyQuery(ctx context.Context, db DBTX) {
	q, ops := New(), sqlops.New()
	at := time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.UTC)
	keys, costs := [][]byte{[]byte("a"), []byte("b")}, []int64{1, 2}
	for i := range 2 {
		ts := at.Add(time.Duration(i) * 1500 * time.Millisecond)
		tsUs := pgtype.Int8{Int64: ts.UnixMicro(), Valid: true}
		_, _ = q.FixedWindowTake(ctx, db, FixedWindowTakeParams{Key: keys[0], Cost: 1, MaxCount: 5, At: &ts, WindowUs: 1e6})
		_, _ = ops.FixedWindowTakeMany(ctx, db, sqlops.FixedWindowTakeManyParams{Keys: keys, Costs: costs, MaxCount: 5, At: &ts, WindowUs: 1e6})
		_, _ = q.FixedWindowPeek(ctx, db, FixedWindowPeekParams{Key: keys[0], At: &ts, WindowUs: 1e6})
		_, _ = q.TokenBucketTake(ctx, db, TokenBucketTakeParams{Key: keys[0], Cost: 1, Capacity: 5, RefillPerUs: 1e-6, At: &ts})
		_, _ = ops.TokenBucketTakeMany(ctx, db, sqlops.TokenBucketTakeManyParams{Keys: keys, Costs: costs, Capacity: 5, RefillPerUs: 1e-6, At: &ts})
		_, _ = q.TokenBucketPeek(ctx, db, TokenBucketPeekParams{Key: keys[0], Capacity: 5, RefillPerUs: 1e-6, At: &ts})
		_, _ = ops.TokenBucketTakePolicy(ctx, db, sqlops.TokenBucketTakePolicyParams{Key: keys[1], Cost: 1, At: &ts, Policy: "tb", OverrideKey: keys[1], KeyMode: "hashed"})
		_, _ = ops.FixedWindowTakeUnderPolicy(ctx, db, sqlops.FixedWindowTakeUnderPolicyParams{Key: keys[1], Cost: 1, MaxCount: 5, At: &ts, WindowUs: 1e6, Policy: "fw", KeyMode: "hashed"})
		_, _ = ops.TokenBucketTakeUnderPolicy(ctx, db, sqlops.TokenBucketTakeUnderPolicyParams{Key: keys[1], Cost: 1, Capacity: 5, RefillPerUs: 1e-6, At: &ts, Policy: "tb", KeyMode: "hashed", RateLimit: 5, Burst: 5, WindowUs: 5e6})
		_, _ = ops.SlidingWindowTakeUnderPolicy(ctx, db, sqlops.SlidingWindowTakeUnderPolicyParams{Key: keys[1], Cost: 1, MaxCount: 5, At: &ts, WindowUs: 1e6, Policy: "sw", KeyMode: "hashed"})
		_, _ = ops.TokenBucketTakeChecks(ctx, db, sqlops.TokenBucketTakeChecksParams{Keys: keys[:1], Capacities: []float64{5}, RefillsPerUs: []float64{1e-6}, Penalties: []bool{false}, Runs: []int32{1}, Ends: []int32{2}, Rows: []int32{1, 1}, Costs: []int64{3, 1}, UpTo: []bool{true, false}, Vetoes: []bool{true, true}, Mins: []int64{1, 0}, Shares: []int64{2, 0}, At: &ts})
		_, _ = ops.TokenBucketReturnSlice(ctx, db, sqlops.TokenBucketReturnSliceParams{Key: keys[0], At: ts, N: 1, Capacity: 5, RefillPerUs: 1e-6, Now: &ts})
		_, _ = q.SlidingWindowTake(ctx, db, SlidingWindowTakeParams{Key: keys[0], Cost: 1, MaxCount: 5, At: &ts, WindowUs: 1e6})
		_, _ = ops.SlidingWindowTakeMany(ctx, db, sqlops.SlidingWindowTakeManyParams{Keys: keys, Costs: costs, MaxCount: 5, At: &ts, WindowUs: 1e6})
		_, _ = q.SlidingWindowPeek(ctx, db, SlidingWindowPeekParams{Key: keys[0], At: &ts, WindowUs: 1e6})
		_, _ = ops.FixedWindowTakeRuns(ctx, db, sqlops.FixedWindowTakeRunsParams{Keys: keys, Ends: []int32{3, 4}, MaxCounts: []int64{5, 5}, WindowsUs: []int64{1e6, 1e6}, At: &ts})
		_, _ = ops.TokenBucketTakeRuns(ctx, db, sqlops.TokenBucketTakeRunsParams{Keys: keys, Ends: []int32{3, 4}, Capacities: []float64{5, 5}, RefillsPerUs: []float64{1e-6, 1e-6}, At: &ts})
		_, _ = ops.SlidingWindowTakeRuns(ctx, db, sqlops.SlidingWindowTakeRunsParams{Keys: keys, Ends: []int32{3, 4}, MaxCounts: []int64{5, 5}, WindowsUs: []int64{1e6, 1e6}, At: &ts})
		_, _ = ops.FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{AtUs: tsUs, WindowUs: 1e6})
	}
}

// everyQueryCalls stores the policies everyQuery's statements read (tb, fw
// and sw) in pool's schema and returns the statements everyQuery sends,
// without running them.
func everyQueryCalls(ctx context.Context, t *testing.T, pool *pgxpool.Pool) []call {
	t.Helper()
	_, err := pool.Exec(ctx, `INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst)
		VALUES ('tb', 'token_bucket', 5, interval '5 seconds', 5), ('fw', 'fixed_window', 5, interval '1 second', NULL),
		       ('sw', 'sliding_window', 5, interval '1 second', NULL)`)
	require.NoError(t, err)
	var calls []call
	everyQuery(ctx, recorder{&calls})
	return calls
}

// TestHelpersAreInlined proves that the planner inlines every helper of
// helperMigrations into every query that uses it: EXPLAIN (VERBOSE) of each
// query names none of them, and running each query, under custom and
// generic plans, calls none of them (track_functions counts every call of a
// function that was not inlined). A control function that cannot be inlined
// (it has a SET clause) shows that both checks see a call when there is one.
func TestHelpersAreInlined(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schemaName := dbtest.Pool(t, dbtest.WithExecMode(pgx.QueryExecModeCacheStatement))
	helpers := helperNames(t)

	calls := everyQueryCalls(ctx, t, pool)
	require.Len(t, calls, 38)

	// The control: a copy of a helper that cannot be inlined.
	_, err := pool.Exec(ctx, `CREATE FUNCTION pgrl_not_inlined(now_us bigint, window_us bigint) RETURNS bigint
		LANGUAGE sql IMMUTABLE SET search_path FROM CURRENT
		AS $$ SELECT pgrl_window_end_us(now_us, window_us) $$`)
	require.NoError(t, err)
	control := "SELECT pgrl_not_inlined(pgrl_epoch_us(now()), $1::bigint)"

	explain := func(tx pgx.Tx, sql string, args ...any) string {
		rows, err := tx.Query(ctx, "EXPLAIN (VERBOSE) "+sql, args...)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err, sql)
		return strings.Join(lines, "\n")
	}
	t.Run("explain", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		plan := explain(tx, control, int64(1e6))
		require.Contains(t, plan, "pgrl_not_inlined", "the control must show its call")
		for _, c := range calls {
			plan := explain(tx, c.sql, c.args...)
			for _, h := range helpers {
				// A whole name: pgrl_token_bucket_take_checks, a function
				// the statement calls, is not the step.
				require.NotRegexp(t, `\b`+h+`\b`, plan, "%s: %s is not inlined:\n%s", c.name, h, plan)
			}
		}
	})

	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		t.Run("calls/"+mode, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, "SET LOCAL track_functions = 'all'")
			require.NoError(t, err)
			_, err = tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode)
			require.NoError(t, err)
			called := func() map[string]int64 {
				rows, err := tx.Query(ctx, `SELECT funcname::text, calls FROM pg_stat_xact_user_functions
					WHERE schemaname = $1 AND calls > 0`, schemaName)
				require.NoError(t, err)
				got := map[string]int64{}
				for rows.Next() {
					var name string
					var n int64
					require.NoError(t, rows.Scan(&name, &n))
					got[name] = n
				}
				require.NoError(t, rows.Err())
				return got
			}

			// Each query runs as a prepared statement, several times, so
			// that force_generic_plan really plans it generically.
			for range 3 {
				_, err := tx.Exec(ctx, control, int64(1e6))
				require.NoError(t, err)
			}
			require.Positive(t, called()["pgrl_not_inlined"], "track_functions must count the control's calls")

			var ran []call
			everyQuery(ctx, runner{tx: tx, t: t, ran: &ran})
			everyQuery(ctx, runner{tx: tx, t: t, ran: &ran})
			require.Len(t, ran, 76)
			got := called()
			for _, h := range helpers {
				require.Zero(t, got[h], "%s was called %d times instead of inlined (%s)", h, got[h], mode)
			}
		})
	}
}

// runner is a DBTX that runs each statement on tx and fails the test when
// one fails.
type runner struct {
	tx  pgx.Tx
	t   *testing.T
	ran *[]call
}

func (r runner) Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	*r.ran = append(*r.ran, call{sql: sql})
	tag, err := r.tx.Exec(ctx, sql, args...)
	require.NoError(r.t, err, sql)
	return tag, err
}

func (r runner) Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	*r.ran = append(*r.ran, call{sql: sql})
	rows, err := r.tx.Query(ctx, sql, args...)
	require.NoError(r.t, err, sql)
	// Read every row now, so that the statement has run when Query returns,
	// and give the caller an empty result.
	_, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) ([]any, error) { return row.Values() })
	require.NoError(r.t, err, sql)
	return r.tx.Query(ctx, "SELECT 1 WHERE false")
}

func (r runner) QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row {
	*r.ran = append(*r.ran, call{sql: sql})
	rows, err := r.tx.Query(ctx, sql, args...)
	require.NoError(r.t, err, sql)
	_, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) ([]any, error) { return row.Values() })
	require.NoError(r.t, err, sql)
	return errRow{}
}
