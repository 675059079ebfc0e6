package cleanup_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
)

const hourUs = int64(time.Hour / time.Microsecond)

var (
	q   = gen.New()
	ops = sqlops.New()
)

// insertExpired inserts n fixed-window rows whose windows ended between one
// and two hours ago, with distinct keys, in one statement.
func insertExpired(t testing.TB, db *pgxpool.Pool, n int) {
	t.Helper()
	_, err := db.Exec(context.Background(), `
		INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT sha256(int8send(g)), statement_timestamp() - interval '1 hour' - (g % 60) * interval '1 minute', 1 + g % 5, true
		  FROM generate_series(1, $1::bigint) AS g`, n)
	require.NoError(t, err)
}

func countRows(t testing.TB, db *pgxpool.Pool, sql string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, db.QueryRow(context.Background(), sql).Scan(&n))
	return n
}

func liveKey(i int) []byte { return []byte(fmt.Sprintf("live-%04d", i)) }

// take runs one fixed-window check at the pinned instant at, healing a
// missing partition the way the library does: on SQLSTATE 23514 it creates
// the partition with FixedWindowEnsurePartition and retries once.
func take(ctx context.Context, db gen.DBTX, key []byte, at time.Time) (gen.FixedWindowTakeRow, error) {
	return takeHealing(ctx, db, gen.FixedWindowTakeParams{Key: key, Cost: 1, MaxCount: 1 << 40, At: &at, WindowUs: hourUs})
}

func takeHealing(ctx context.Context, db gen.DBTX, p gen.FixedWindowTakeParams) (gen.FixedWindowTakeRow, error) {
	row, err := q.FixedWindowTake(ctx, db, p)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23514" {
		var at pgtype.Int8
		if p.At != nil {
			at = pgtype.Int8{Int64: p.At.UnixMicro(), Valid: true}
		}
		if _, err := ops.FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{AtUs: at, WindowUs: p.WindowUs}); err != nil {
			return row, err
		}
		row, err = q.FixedWindowTake(ctx, db, p)
	}
	return row, err
}

// checkers issues checks on nKeys live keys from workers goroutines until
// stop is closed, and returns how many checks each key received.
type checkers struct {
	wg     sync.WaitGroup
	counts []atomic.Int64
	errs   atomic.Int64
	total  atomic.Int64
	stop   chan struct{}
}

func startCheckers(t *testing.T, db *pgxpool.Pool, at time.Time, nKeys, workers int) *checkers {
	c := &checkers{counts: make([]atomic.Int64, nKeys), stop: make(chan struct{})}
	for w := 0; w < workers; w++ {
		c.wg.Add(1)
		go func(w int) {
			defer c.wg.Done()
			for i := w; ; i += workers {
				select {
				case <-c.stop:
					return
				default:
				}
				k := i % nKeys
				if _, err := take(context.Background(), db, liveKey(k), at); err != nil {
					t.Errorf("check during cleanup: %v", err)
					c.errs.Add(1)
					return
				}
				c.counts[k].Add(1)
				c.total.Add(1)
			}
		}(w)
	}
	return c
}

func (c *checkers) finish() { close(c.stop); c.wg.Wait() }

// requireLiveCounts asserts that every live key's counter holds exactly the
// checks it received.
func requireLiveCounts(t *testing.T, db *pgxpool.Pool, at time.Time, c *checkers) {
	t.Helper()
	for k := range c.counts {
		peek, err := q.FixedWindowPeek(context.Background(), db, gen.FixedWindowPeekParams{Key: liveKey(k), At: &at, WindowUs: hourUs})
		require.NoError(t, err)
		require.Equal(t, c.counts[k].Load(), peek.Count, "live key %d", k)
	}
}

func TestDeleteModeMillionExpiredRowsKeepsLiveCounters(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	insertExpired(t, db, 1_000_000)

	// Live counters sit in a window ten days ahead (pinned clock), so no
	// window boundary passes during the test.
	at := time.Now().Add(240 * time.Hour)
	const nKeys = 200
	for k := 0; k < nKeys; k++ {
		_, err := take(ctx, db, liveKey(k), at)
		require.NoError(t, err)
	}
	c := startCheckers(t, db, at, nKeys, 3)
	for k := 0; k < nKeys; k++ {
		c.counts[k].Add(1) // the check above
	}
	res, err := cleanup.Run(ctx, db, cleanup.Options{})
	before := c.total.Load()
	// Let the checkers run a little past the cleanup's end too.
	time.Sleep(50 * time.Millisecond)
	c.finish()
	require.NoError(t, err)
	require.Zero(t, c.errs.Load())

	require.False(t, res.Skipped)
	require.False(t, res.StoppedEarly)
	require.Equal(t, int64(1_000_000), res.Tables.FixedWindow.Deleted)
	require.GreaterOrEqual(t, res.Tables.FixedWindow.Batches, 200)
	require.Greater(t, before, int64(0), "checks ran during the cleanup")
	require.Zero(t, countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window WHERE expires_at <= now()"))
	require.Equal(t, int64(nKeys), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
	requireLiveCounts(t, db, at, c)
	t.Logf("deleted %d rows in %d batches, %s; %d checks ran meanwhile", res.Tables.FixedWindow.Deleted, res.Batches, res.Duration, before)
}

func TestPartitionModeDropsPastPartitionWhileChecksRun(t *testing.T) {
	t.Parallel()
	db, schema := dbtest.Pool(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, "SELECT pgrl_fixed_window_set_layout('partitioned', '1 hour')")
	require.NoError(t, err)

	// A past partition: the one holding windows that ended 2h ago. Its upper
	// bound is at most an hour ago, so it can only hold dead rows.
	var pastLo, pastHi time.Time
	_, err = db.Exec(ctx, "SELECT pgrl_fixed_window_ensure_partitions(now() - interval '2 hours', now() - interval '2 hours')")
	require.NoError(t, err)
	require.NoError(t, db.QueryRow(ctx, `
		SELECT to_timestamp(floor(extract(epoch FROM now() - interval '2 hours') / 3600) * 3600),
		       to_timestamp(floor(extract(epoch FROM now() - interval '2 hours') / 3600) * 3600 + 3600)`).Scan(&pastLo, &pastHi))
	_, err = db.Exec(ctx, `
		INSERT INTO pgrl_fixed_window (key, expires_at, count, allowed)
		SELECT sha256(int8send(g)), $1::timestamptz + (g % 3600) * interval '1 second', 1, true
		  FROM generate_series(1, 1000000) AS g`, pastLo)
	require.NoError(t, err)
	pastName := cleanup.PartitionName(pastLo)

	// A check into a window whose partition was never created (ten days
	// ahead, beyond any Options.Horizon) fails with 23514 and succeeds once healed.
	at := time.Now().Add(240 * time.Hour)
	_, err = q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{Key: liveKey(0), Cost: 1, MaxCount: 10, At: &at, WindowUs: hourUs})
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23514", pgErr.Code)
	created, err := ops.FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{AtUs: pgtype.Int8{Int64: at.UnixMicro(), Valid: true}, WindowUs: hourUs})
	require.NoError(t, err)
	require.Equal(t, int32(1), created)
	row, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{Key: liveKey(0), Cost: 1, MaxCount: 10, At: &at, WindowUs: hourUs})
	require.NoError(t, err)
	require.True(t, row.Allowed)
	require.Equal(t, int64(1), row.Count)

	// Live rows in the current window too, on the real clock.
	const nCurrent = 50
	for k := 0; k < nCurrent; k++ {
		_, err := takeHealing(ctx, db, gen.FixedWindowTakeParams{Key: liveKey(k), Cost: 1, MaxCount: 10, WindowUs: 24 * hourUs})
		require.NoError(t, err)
	}

	const nKeys = 100
	c := startCheckers(t, db, at, nKeys, 3)
	c.counts[0].Add(1)
	res, err := cleanup.Run(ctx, db, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 6 * time.Hour})
	time.Sleep(50 * time.Millisecond)
	c.finish()
	require.NoError(t, err)
	require.Zero(t, c.errs.Load())

	require.False(t, res.Skipped)
	require.NotNil(t, res.Partitions)
	require.Contains(t, res.Partitions.Dropped, pastName)
	require.Equal(t, int64(1_000_000), res.Partitions.RowsDropped)
	// DETACH … CONCURRENTLY exists from PostgreSQL 14 on; 13 gets the
	// plain DETACH. Ask the server which it is rather than assume.
	var versionNum int
	require.NoError(t, db.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&versionNum))
	wantDetach := "concurrently"
	if versionNum < 140000 {
		wantDetach = "plain"
	}
	require.Equal(t, wantDetach, res.Partitions.Detach, "server_version_num %d", versionNum)
	require.Positive(t, res.Partitions.Created, "partitions created ahead")
	// Every hour from now to now + Horizon has its partition, whichever of
	// them existed before the run (checks and earlier heals create some).
	var uncovered int
	require.NoError(t, db.QueryRow(ctx, `
		SELECT count(*) FROM generate_series(now(), now() + interval '6 hours', interval '1 hour') AS h
		 WHERE NOT EXISTS (
		       SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		        WHERE i.inhparent = 'pgrl_fixed_window'::regclass
		          AND c.relname = 'pgrl_fixed_window_' || to_char(date_trunc('hour', h) AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS'))`).Scan(&uncovered))
	require.Zero(t, uncovered, "partitions exist up to now + Horizon")
	require.Zero(t, res.Tables.FixedWindow.Batches, "partition mode deletes no fixed-window rows one by one")

	var exists bool
	require.NoError(t, db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", schema+"."+pastName).Scan(&exists))
	require.False(t, exists, "the past partition is gone")
	parts, err := ops.FixedWindowPartitions(ctx, db)
	require.NoError(t, err)
	for _, p := range parts {
		require.False(t, p.Past, "partition %s is past but was kept", p.PartitionName)
	}
	require.Equal(t, int64(nCurrent+nKeys), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
	requireLiveCounts(t, db, at, c)
	for k := 0; k < nCurrent; k++ {
		peek, err := q.FixedWindowPeek(ctx, db, gen.FixedWindowPeekParams{Key: liveKey(k), WindowUs: 24 * hourUs})
		require.NoError(t, err)
		require.Equal(t, int64(1), peek.Count)
	}

	// A second run finds nothing more to drop.
	res, err = cleanup.Run(ctx, db, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 6 * time.Hour})
	require.NoError(t, err)
	require.Empty(t, res.Partitions.Dropped)
	require.Zero(t, res.Partitions.Created)
}

// seedAllTables writes dead and live rows into the three tables through the
// generated check queries, with pinned clocks: the dead ones far in the past.
func seedAllTables(t *testing.T, db *pgxpool.Pool, fwDead, fwLive, tbDead, tbLive, swDead, swLive int) {
	t.Helper()
	ctx := context.Background()
	past := time.Now().Add(-48 * time.Hour)
	future := time.Now().Add(240 * time.Hour)
	for i := 0; i < fwDead; i++ {
		_, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{Key: []byte(fmt.Sprintf("fd%d", i)), Cost: 1, MaxCount: 5, At: &past, WindowUs: hourUs})
		require.NoError(t, err)
	}
	for i := 0; i < fwLive; i++ {
		_, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{Key: []byte(fmt.Sprintf("fl%d", i)), Cost: 1, MaxCount: 5, At: &future, WindowUs: hourUs})
		require.NoError(t, err)
	}
	// Token buckets: capacity 10 refilling 1 per second; a bucket checked
	// two days ago is full again, one checked ten days ahead is not.
	for i := 0; i < tbDead+tbLive; i++ {
		at := past
		if i >= tbDead {
			at = future
		}
		_, err := q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{Key: []byte(fmt.Sprintf("tb%d", i)), Cost: 3, Capacity: 10, RefillPerUs: 1e-6, At: &at})
		require.NoError(t, err)
	}
	for i := 0; i < swDead+swLive; i++ {
		at := past
		if i >= swDead {
			at = future
		}
		_, err := q.SlidingWindowTake(ctx, db, gen.SlidingWindowTakeParams{Key: []byte(fmt.Sprintf("sw%d", i)), Cost: 1, MaxCount: 5, At: &at, WindowUs: hourUs})
		require.NoError(t, err)
	}
}

func TestDryRunCountsAndDeletesNothing(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	seedAllTables(t, db, 37, 11, 23, 7, 19, 5)
	// The answers of checks with a request id: 13 kept past their
	// retention, 4 not.
	_, err := db.Exec(ctx, `INSERT INTO pgrl_request (key, id, expires_at, result)
		SELECT int8send(i), substring(decode(md5(i::text), 'hex') for 16),
		       now() + CASE WHEN i <= 13 THEN interval '-1 hour' ELSE interval '1 hour' END, '[]'
		  FROM generate_series(1, 17) AS i`)
	require.NoError(t, err)
	// Concurrency limits: 29 keys whose every slot has lapsed, 6 holding one.
	insertSlots(t, db, "lapsed", 29, -time.Hour)
	insertSlots(t, db, "held", 6, time.Hour)

	res, err := cleanup.Run(ctx, db, cleanup.Options{DryRun: true})
	require.NoError(t, err)
	require.True(t, res.DryRun)
	require.Equal(t, cleanup.TableResult{WouldDelete: 37}, res.Tables.FixedWindow)
	require.Equal(t, cleanup.TableResult{WouldDelete: 23}, res.Tables.TokenBucket)
	require.Equal(t, cleanup.TableResult{WouldDelete: 19}, res.Tables.SlidingWindow)
	require.Equal(t, cleanup.TableResult{WouldDelete: 13}, res.Tables.Requests)
	require.Equal(t, cleanup.TableResult{WouldDelete: 29}, res.Tables.Concurrency)
	require.Zero(t, res.Batches)
	require.Equal(t, int64(35), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
	require.Equal(t, int64(48), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
	require.Equal(t, int64(30), countRows(t, db, "SELECT count(*) FROM pgrl_token_bucket"))
	require.Equal(t, int64(24), countRows(t, db, "SELECT count(*) FROM pgrl_sliding_window"))

	// The real run deletes exactly what the dry run counted, in batches of
	// the given size.
	res, err = cleanup.Run(ctx, db, cleanup.Options{BatchSize: 10, Vacuum: true})
	require.NoError(t, err)
	require.Equal(t, cleanup.TableResult{Deleted: 37, Batches: 4, Vacuumed: true}, res.Tables.FixedWindow)
	require.Equal(t, cleanup.TableResult{Deleted: 23, Batches: 3, Vacuumed: true}, res.Tables.TokenBucket)
	require.Equal(t, cleanup.TableResult{Deleted: 19, Batches: 2, Vacuumed: true}, res.Tables.SlidingWindow)
	require.Equal(t, cleanup.TableResult{Deleted: 13, Batches: 2, Vacuumed: true}, res.Tables.Requests)
	require.Equal(t, cleanup.TableResult{Deleted: 29, Batches: 3, Vacuumed: true}, res.Tables.Concurrency)
	require.Equal(t, 14, res.Batches)
	require.Equal(t, int64(6), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
	require.Equal(t, int64(4), countRows(t, db, "SELECT count(*) FROM pgrl_request"))
	require.Equal(t, int64(11), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
	require.Equal(t, int64(7), countRows(t, db, "SELECT count(*) FROM pgrl_token_bucket"))
	require.Equal(t, int64(5), countRows(t, db, "SELECT count(*) FROM pgrl_sliding_window"))
}

func TestPartitionDryRunDropsNothing(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, "SELECT pgrl_fixed_window_set_layout('partitioned', '1 hour')")
	require.NoError(t, err)
	_, err = db.Exec(ctx, `SELECT pgrl_fixed_window_ensure_partitions(now() - interval '5 hours', now() - interval '3 hours')`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `INSERT INTO pgrl_fixed_window SELECT sha256(int8send(g)), now() - interval '4 hours', 1, true FROM generate_series(1, 321) g`)
	require.NoError(t, err)
	before, err := ops.FixedWindowPartitions(ctx, db)
	require.NoError(t, err)

	res, err := cleanup.Run(ctx, db, cleanup.Options{Mode: cleanup.ModePartitions, DryRun: true, Horizon: 3 * time.Hour})
	require.NoError(t, err)
	require.Len(t, res.Partitions.Dropped, 3)
	require.Equal(t, int64(321), res.Partitions.RowsDropped)
	// set_layout made the current partition and the next; three hours
	// ahead needs two or three more, depending on where in the hour we are.
	require.GreaterOrEqual(t, res.Partitions.Created, 2)
	after, err := ops.FixedWindowPartitions(ctx, db)
	require.NoError(t, err)
	require.Equal(t, before, after)
	require.Equal(t, int64(321), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))

	res2, err := cleanup.Run(ctx, db, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 3 * time.Hour})
	require.NoError(t, err)
	require.Equal(t, res.Partitions.Dropped, res2.Partitions.Dropped)
	require.Equal(t, res.Partitions.Created, res2.Partitions.Created)
	require.Zero(t, countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}

func TestPartitionModeOnPlainLayoutIsRefused(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	insertExpired(t, db, 100)
	_, err := cleanup.Run(context.Background(), db, cleanup.Options{Mode: cleanup.ModePartitions})
	require.ErrorIs(t, err, cleanup.ErrPlainLayout)
	require.Contains(t, err.Error(), "rl-migrate layout partitioned")
	require.Equal(t, int64(100), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}

// The error for missing tables names where cleanup looked: the schema,
// the database and the user, and the fix with that schema.
func TestMissingTablesNameTheFix(t *testing.T) {
	t.Parallel()
	schema := dbtest.NewSchema(t)
	db := dbtest.PoolOn(t, schema)
	var database, user string
	require.NoError(t, db.QueryRow(context.Background(), "SELECT current_database(), current_user").Scan(&database, &user))
	_, err := cleanup.Run(context.Background(), db, cleanup.Options{})
	require.ErrorIs(t, err, cleanup.ErrNotMigrated)
	require.Contains(t, err.Error(), fmt.Sprintf("pgrl's tables are missing in schema %q of database %q (user %q)", schema, database, user))
	require.Contains(t, err.Error(), "rl-migrate up --schema "+schema)
	require.NotContains(t, err.Error(), "not found:", "no table exists: the message does not list them")

	// Some tables missing: they are named.
	_, err = dbtest.Admin(t).Exec(context.Background(), "CREATE TABLE "+schema+".pgrl_fixed_window (x int)")
	require.NoError(t, err)
	_, err = cleanup.Run(context.Background(), db, cleanup.Options{})
	require.ErrorIs(t, err, cleanup.ErrNotMigrated)
	require.Contains(t, err.Error(), "(not found: pgrl_token_bucket, pgrl_sliding_window, pgrl_partition_settings)")

	// A search_path none of whose schemas exists is said to be one.
	db = dbtest.PoolOn(t, "pgrl_no_such_schema")
	_, err = cleanup.Run(context.Background(), db, cleanup.Options{})
	require.ErrorIs(t, err, cleanup.ErrNotMigrated)
	require.Contains(t, err.Error(), `no schema of search_path "pgrl_no_such_schema" exists in database`)
}

func TestInvalidOptions(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	insertExpired(t, db, 10)
	for _, o := range []cleanup.Options{
		{BatchSize: -1},
		{MaxDuration: -time.Second},
		{Horizon: -time.Hour},
		{LockTimeout: -time.Second},
		{StatementTimeout: -time.Second},
		{Mode: cleanup.Mode(7)},
	} {
		_, err := cleanup.Run(context.Background(), db, o)
		require.ErrorIs(t, err, cleanup.ErrInvalidOptions, "%+v", o)
	}
	require.Equal(t, int64(10), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}

func TestSecondRunIsSkippedWhileFirstHoldsTheLock(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	insertExpired(t, db, 10)
	holder, err := db.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	locked, err := ops.CleanupTryLock(ctx, holder)
	require.NoError(t, err)
	require.True(t, locked)

	res, err := cleanup.Run(ctx, db, cleanup.Options{})
	require.NoError(t, err)
	require.True(t, res.Skipped)
	require.Equal(t, cleanup.SkippedAnotherRunning, res.SkippedReason)
	require.Equal(t, int64(10), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))

	_, err = ops.CleanupUnlock(ctx, holder)
	require.NoError(t, err)
	res, err = cleanup.Run(ctx, db, cleanup.Options{})
	require.NoError(t, err)
	require.False(t, res.Skipped)
	require.Equal(t, int64(10), res.Tables.FixedWindow.Deleted)

	// The pool connection came back with its settings restored and the lock
	// released: taking the lock on any connection works.
	locked, err = ops.CleanupTryLock(ctx, holder)
	require.NoError(t, err)
	require.True(t, locked)
	_, err = ops.CleanupUnlock(ctx, holder)
	require.NoError(t, err)
}

func TestCancelStopsBetweenBatches(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	insertExpired(t, db, 1000)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res, err := cleanup.Run(ctx, db, cleanup.Options{BatchSize: 100, Progress: func(p cleanup.Progress) {
		if p.Batches == 3 {
			cancel()
		}
	}})
	require.NoError(t, err)
	require.True(t, res.StoppedEarly)
	require.Equal(t, "cancelled", res.StopReason)
	require.Equal(t, 3, res.Tables.FixedWindow.Batches)
	require.Equal(t, int64(300), res.Tables.FixedWindow.Deleted)
	require.Equal(t, int64(700), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}

func TestMaxDurationStopsTheRun(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	insertExpired(t, db, 1000)
	ctx := context.Background()
	// Baseline: how long a run takes here to set up and delete one batch.
	// The budget is three times that (at least 100 ms), so the run gets
	// through setup and deletes something even on a busy machine; the pause
	// between batches makes the other 98 batches need five budgets at the
	// least, so it cannot finish within one.
	first, err := cleanup.Run(ctx, db, cleanup.Options{BatchSize: 10, MaxBatches: 1})
	require.NoError(t, err)
	require.Equal(t, int64(10), first.Tables.FixedWindow.Deleted)
	budget := max(100*time.Millisecond, 3*first.Duration)
	pause := budget / 20
	res, err := cleanup.Run(ctx, db, cleanup.Options{BatchSize: 10, BatchPause: pause, MaxDuration: budget})
	require.NoError(t, err)
	t.Logf("one batch took %v; with a budget of %v and %v pauses the run deleted %d rows in %v",
		first.Duration, budget, pause, res.Tables.FixedWindow.Deleted, res.Duration)
	require.True(t, res.StoppedEarly)
	require.Equal(t, "max-duration", res.StopReason)
	require.Less(t, res.Tables.FixedWindow.Deleted, int64(990))
	require.Greater(t, res.Tables.FixedWindow.Deleted, int64(0))
	// It stops between batches: past the budget by a pause and a batch,
	// which a busy machine stretches (one batch took over 100 ms beside a
	// 2-core CPU load, three times the baseline). Bounded by four budgets:
	// without the cap the run needs 98 pauses at the least, 4.9 budgets,
	// so a run this short was cut by it.
	require.Less(t, res.Duration, 4*budget)
}

// TestChurnKeepsTableSizeBounded writes many keys over several windows
// (pinned clock), cleaning up after every window, and checks the table's
// size on disk never grows past twice its size after the first window.
func TestChurnKeepsTableSizeBounded(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	const (
		keys    = 3000
		windows = 8
		workers = 4
		winUs   = int64(time.Minute / time.Microsecond)
	)
	base := time.Now().Truncate(time.Minute).Add(-24 * time.Hour)
	var first int64
	for w := 0; w < windows; w++ {
		at := base.Add(time.Duration(w)*time.Minute + 30*time.Second)
		var wg sync.WaitGroup
		for g := 0; g < workers; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				for k := g; k < keys; k += workers {
					for n := 0; n < 2; n++ {
						_, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{Key: []byte(fmt.Sprintf("churn-%05d", k)), Cost: 1, MaxCount: 10, At: &at, WindowUs: winUs})
						if err != nil {
							t.Error(err)
							return
						}
					}
				}
			}(g)
		}
		wg.Wait()
		require.Equal(t, int64(keys), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
		size := countRows(t, db, "SELECT pg_total_relation_size('pgrl_fixed_window')")
		if w == 0 {
			first = size
		}
		t.Logf("window %d: %d bytes", w, size)
		require.LessOrEqual(t, size, 2*first, "window %d: table grew from %d to %d bytes", w, first, size)

		// The window has ended: clean up as cron would right after it.
		end := base.Add(time.Duration(w+1) * time.Minute)
		res, err := cleanup.Run(ctx, db, cleanup.Options{At: &end})
		require.NoError(t, err)
		require.Equal(t, int64(keys), res.Tables.FixedWindow.Deleted)
		// Autovacuum would now make the space reusable, within a minute; do
		// its work here, once no other test's snapshot still sees the rows.
		waitForVacuumHorizon(t, db)
		_, err = db.Exec(ctx, "VACUUM pgrl_fixed_window")
		require.NoError(t, err)
	}
}

// waitForVacuumHorizon waits until no other session of the database holds a
// snapshot or a transaction older than now, so that VACUUM can remove the
// rows deleted so far. Other tests (and other packages' tests) share the
// database; their long statements would otherwise keep the deleted rows on
// disk. Every kind of backend counts: an autovacuum worker's ANALYZE holds
// a snapshot too.
func waitForVacuumHorizon(t *testing.T, db *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var xid string
	require.NoError(t, db.QueryRow(ctx, "SELECT (txid_current() % 4294967296)::text").Scan(&xid))
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var older int
		require.NoError(t, db.QueryRow(ctx, `
			SELECT count(*)::int FROM pg_stat_activity
			 WHERE datname = current_database() AND pid <> pg_backend_pid()
			   AND (age(backend_xmin) >= age($1::text::xid) OR age(backend_xid) >= age($1::text::xid))`,
			xid).Scan(&older))
		if older == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("other sessions kept old snapshots open for 2 minutes")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestOpportunisticRunsOneSmallBatchInTheBackground(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	insertExpired(t, db, 2500)
	o := &cleanup.Opportunistic{Every: 10, BatchSize: 1000}
	var nilO *cleanup.Opportunistic
	nilO.Maybe(context.Background(), db) // a nil value is a no-op
	for i := 0; i < 9; i++ {
		o.Maybe(context.Background(), db)
	}
	o.Wait()
	require.Zero(t, o.Started())
	require.Equal(t, int64(2500), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))

	ctx, cancel := context.WithCancel(context.Background())
	o.Maybe(ctx, db) // the tenth call
	cancel()         // the request ends at once; the cleanup carries on
	o.Wait()
	require.Equal(t, uint64(1), o.Started())
	require.Equal(t, int64(1500), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))

	// Many calls at once start at most one cleanup at a time.
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 100; i++ {
				o.Maybe(context.Background(), db)
			}
		}()
	}
	wg.Wait()
	o.Wait()
	started := o.Started()
	require.Greater(t, started, uint64(1))
	require.LessOrEqual(t, started, uint64(81))
	// Each cleanup deleted one batch of at most 1000 rows.
	left := max(0, 1500-1000*int64(started-1))
	require.Equal(t, left, countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}
