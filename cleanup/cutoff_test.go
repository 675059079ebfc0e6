package cleanup_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// waitPastBoundary sleeps until 100ms after the next multiple of every on the
// database clock, so that a transaction begun right after starts early in a
// window.
func waitPastBoundary(t *testing.T, db *pgxpool.Pool, every time.Duration) {
	t.Helper()
	var now time.Time
	require.NoError(t, db.QueryRow(context.Background(), "SELECT statement_timestamp()").Scan(&now))
	next := now.Truncate(every).Add(every)
	time.Sleep(next.Sub(now) + 100*time.Millisecond)
}

// partitionTwoSeconds switches pgrl_fixed_window to the partitioned layout
// with 2-second partitions, creating only the few that the next 20 seconds
// need (switching with a 2-second width directly would create an hour of
// them in one transaction).
func partitionTwoSeconds(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Exec(ctx, "SELECT pgrl_fixed_window_set_layout('partitioned', interval '1 hour')")
	require.NoError(t, err)
	rows, err := db.Query(ctx, "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE i.inhparent = 'pgrl_fixed_window'::regclass")
	require.NoError(t, err)
	var parts []string
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		parts = append(parts, p)
	}
	require.NoError(t, rows.Err())
	for _, p := range parts {
		_, err := db.Exec(ctx, "DROP TABLE "+p)
		require.NoError(t, err)
	}
	_, err = db.Exec(ctx, "UPDATE pgrl_partition_settings SET partition_seconds = 2 WHERE table_name = 'pgrl_fixed_window'")
	require.NoError(t, err)
	_, err = db.Exec(ctx, "SELECT pgrl_fixed_window_ensure_partitions(now(), now() + interval '20 seconds')")
	require.NoError(t, err)
}

// algorithmRows counts the rows the algorithm's table holds.
func algorithmRows(t *testing.T, db *pgxpool.Pool, alg ratelimit.Algorithm) int64 {
	return countRows(t, db, "SELECT count(*) FROM pgrl_"+string(alg))
}

// TestCleanupKeepsRowsAnOpenTransactionStillDecidesOn is the scenario of a
// transaction that began inside a window which has since ended: it still
// decides at its start, inside that window, so the window's row must survive
// cleanup until the transaction ends. For every algorithm and both modes.
func TestCleanupKeepsRowsAnOpenTransactionStillDecidesOn(t *testing.T) {
	t.Parallel()
	const window = 2 * time.Second
	for _, alg := range ratelimit.Algorithms {
		for _, mode := range []cleanup.Mode{cleanup.ModeDelete, cleanup.ModePartitions} {
			t.Run(fmt.Sprintf("%s/%s", alg, mode), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				db, _ := dbtest.Pool(t)
				if mode == cleanup.ModePartitions {
					partitionTwoSeconds(t, db)
				}
				// Every check must be PostgreSQL's answer: wait for it as long as
				// it takes on a busy machine (a late answer under the default
				// Timeout would come from the memory tier).
				cfg := ratelimit.Config{Name: "cutoff", Algorithm: alg, Limit: 2, Window: window}
				dbOpts := ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout}
				outside, err := testkit.New(db, cfg, dbOpts)
				require.NoError(t, err)
				inside, err := testkit.New(db, cfg, dbOpts)
				require.NoError(t, err)

				waitPastBoundary(t, db, window)
				tx, err := db.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				var txStart time.Time
				var txPid int32
				require.NoError(t, tx.QueryRow(ctx, "SELECT now(), pg_backend_pid()").Scan(&txStart, &txPid))

				var last ratelimit.Decision
				for i, want := range []bool{true, true, false} {
					d, err := outside.Allow(ctx, "k")
					require.NoError(t, err)
					require.Equal(t, ratelimit.StorePostgres, d.Store, "check %d outside the transaction: %s", i+1, d.Reason)
					require.Equal(t, want, d.Allowed, "check %d outside the transaction", i+1)
					last = d
				}

				// Wait until the row is dead for a cleanup that ignores the
				// transaction: past the window's end (fixed), the bucket's
				// refill (token), two windows (sliding), and, in partition
				// mode, past the upper bound of the partition holding it.
				wait := 2*window + 500*time.Millisecond
				if alg == ratelimit.SlidingWindow || mode == cleanup.ModePartitions {
					wait = 3*window + 500*time.Millisecond
				}
				time.Sleep(wait)
				require.Equal(t, int64(1), algorithmRows(t, db, alg))

				// A generous lock timeout: partition creation in other schemas of the
				// database shares one advisory lock.
				opts := cleanup.Options{Mode: mode, Horizon: 10 * time.Second, LockTimeout: 10 * time.Second}
				res, err := cleanup.Run(ctx, db, opts)
				require.NoError(t, err)
				require.False(t, res.Skipped)
				require.False(t, res.Cutoff.After(txStart), "cutoff %s is after the open transaction's start %s", res.Cutoff, txStart)

				d, err := inside.AllowTx(ctx, tx, "k")
				require.NoError(t, err)
				require.False(t, d.Allowed, "the transaction decides at its start, inside the exhausted window")
				if alg == ratelimit.FixedWindow {
					require.Equal(t, last.ResetAt, d.ResetAt)
				}
				require.NoError(t, tx.Rollback(ctx))

				// Once the transaction has ended it holds nothing back. Other
				// tests' transactions in the same database may still hold the
				// cutoff; when nothing does, the row is gone.
				res, err = cleanup.Run(ctx, db, opts)
				require.NoError(t, err)
				require.NotContains(t, res.CutoffHeldBy, fmt.Sprintf("pid %d ", txPid))
				if res.CutoffHeldBy == "" {
					require.Zero(t, algorithmRows(t, db, alg))
				}
			})
		}
	}
}

// insertDeadSince inserts one row in each table that became dead at the
// database clock minus ago.
func insertDeadSince(t *testing.T, db *pgxpool.Pool, ago time.Duration) {
	t.Helper()
	ctx := context.Background()
	us := ago.Microseconds()
	for _, sql := range []string{
		"INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed) VALUES ('k', statement_timestamp() - $1 * interval '1 microsecond', 2, false)",
		"INSERT INTO pgrl_token_bucket (key, tokens, updated_at, full_at, allowed) VALUES ('k', 0, statement_timestamp() - interval '1 hour', statement_timestamp() - $1 * interval '1 microsecond', false)",
		"INSERT INTO pgrl_sliding_window (key, window_start, count, prev_count, expires_at, allowed) VALUES ('k', statement_timestamp() - interval '1 hour', 2, 0, statement_timestamp() - $1 * interval '1 microsecond', false)",
		"INSERT INTO pgrl_concurrency (key, slots, expires_at, updated_at) SELECT 'k', ARRAY[ROW('t'::bytea, pgrl_epoch_us(x.e))::pgrl_slot], x.e, statement_timestamp() - interval '1 hour' FROM (SELECT statement_timestamp() - $1 * interval '1 microsecond' AS e) AS x",
	} {
		_, err := db.Exec(ctx, sql, us)
		require.NoError(t, err)
	}
}

func allRows(t *testing.T, db *pgxpool.Pool) int64 {
	return countRows(t, db, "SELECT (SELECT count(*) FROM pgrl_fixed_window) + (SELECT count(*) FROM pgrl_token_bucket) + (SELECT count(*) FROM pgrl_sliding_window) + (SELECT count(*) FROM pgrl_concurrency)")
}

// TestMaxGraceBoundsAnIdleTransaction: a transaction left open holds the
// cutoff at its start, but never more than MaxGrace before the clock.
func TestMaxGraceBoundsAnIdleTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := dbtest.Pool(t)
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var txStart time.Time
	var pid int32
	require.NoError(t, tx.QueryRow(ctx, "SELECT now(), pg_backend_pid()").Scan(&txStart, &pid))
	time.Sleep(400 * time.Millisecond)
	insertDeadSince(t, db, 100*time.Millisecond) // dead after the transaction began

	res, err := cleanup.Run(ctx, db, cleanup.Options{})
	require.NoError(t, err)
	require.Equal(t, int64(4), allRows(t, db), "rows dead only after the open transaction began are kept")
	require.False(t, res.Cutoff.After(txStart))
	require.Contains(t, res.CutoffHeldBy, "transaction of pid")

	res, err = cleanup.Run(ctx, db, cleanup.Options{MaxGrace: 50 * time.Millisecond})
	require.NoError(t, err)
	require.Zero(t, allRows(t, db), "a transaction older than MaxGrace holds nothing back")
	require.True(t, res.Cutoff.After(txStart))
	require.Contains(t, res.CutoffHeldBy, "max grace")
}

// TestOpportunisticCleanupRespectsOpenTransactions: the request-path cleanup
// computes the same cutoff as a cron run.
func TestOpportunisticCleanupRespectsOpenTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := dbtest.Pool(t)
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT 1")
	require.NoError(t, err)
	time.Sleep(300 * time.Millisecond)
	insertDeadSince(t, db, 100*time.Millisecond)

	o := &cleanup.Opportunistic{Every: 1}
	o.Maybe(ctx, db)
	o.Wait()
	require.Equal(t, uint64(1), o.Started())
	require.Equal(t, int64(4), allRows(t, db), "rows an open transaction can still read are kept")

	// Once it has ended, a run with a short grace (other tests' transactions
	// may be open) removes them.
	require.NoError(t, tx.Rollback(ctx))
	_, err = cleanup.Run(ctx, db, cleanup.Options{MaxGrace: 50 * time.Millisecond})
	require.NoError(t, err)
	require.Zero(t, allRows(t, db))
}
