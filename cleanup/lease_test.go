package cleanup_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// A token bucket row whose leases may still have units out is not dead
// when its tokens alone would have refilled: deleting it would forget the
// units, and the fresh full bucket the next check finds would admit them
// again. full_at (migration 000016) is not before the end of the lease
// epoch after the one the units were leased in, for the slice and for
// every later check of the row, and both delete modes' queries keep it
// until then.
func TestTokenBucketRowWithLeasesIsKept(t *testing.T) {
	t.Parallel()
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	ops := sqlops.New()
	epoch := time.Date(2030, 1, 2, 3, 4, 0, 0, time.UTC) // a lease epoch's start
	at := func(d time.Duration) *time.Time { ts := epoch.Add(d); return &ts }
	// Capacity 10, 1,000 tokens a second: the tokens are back within 10 ms.
	const capacity, refill = 10, 1e-3
	require.NoError(t, takeSlice(ctx, db, "leased", 6, capacity, refill, at(300*time.Millisecond)))
	// A plain check later in the epoch keeps the row's leases' full_at.
	_, err := q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
		Key: []byte("leased"), Cost: 1, Capacity: capacity, RefillPerUs: refill, At: at(900 * time.Millisecond)})
	require.NoError(t, err)
	// The same spending without a lease: full again 6 ms later.
	_, err = q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
		Key: []byte("plain"), Cost: 6, Capacity: capacity, RefillPerUs: refill, At: at(300 * time.Millisecond)})
	require.NoError(t, err)

	rows := func() []string {
		t.Helper()
		r, err := db.Query(ctx, "SELECT key FROM pgrl_token_bucket ORDER BY key")
		require.NoError(t, err)
		var keys []string
		for r.Next() {
			var k []byte
			require.NoError(t, r.Scan(&k))
			keys = append(keys, string(k))
		}
		require.NoError(t, r.Err())
		return keys
	}
	for _, c := range []struct {
		cutoff time.Duration
		dead   int64
	}{{500 * time.Millisecond, 1}, {1500 * time.Millisecond, 1}, {1999 * time.Millisecond, 1}} {
		cut := pgtype.Int8{Int64: at(c.cutoff).UnixMicro(), Valid: true}
		n, err := ops.TokenBucketCountFull(ctx, db, cut)
		require.NoError(t, err)
		require.Equal(t, c.dead, n, "cutoff %v: only the unleased row is full", c.cutoff)
	}
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	n, err := ops.TokenBucketDeleteFullBatch(ctx, tx, sqlops.TokenBucketDeleteFullBatchParams{
		AtUs: pgtype.Int8{Int64: at(1999 * time.Millisecond).UnixMicro(), Valid: true}, BatchSize: 100})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = ops.TokenBucketDeleteFullBatchByKey(ctx, tx, sqlops.TokenBucketDeleteFullBatchByKeyParams{
		AtUs: at(1999 * time.Millisecond).UnixMicro(), BatchSize: 100})
	require.NoError(t, err)
	require.Zero(t, n)
	require.NoError(t, tx.Rollback(ctx))

	// From the end of the epoch after the lease's, the leases are over and
	// the row is as good as none.
	cut := pgtype.Int8{Int64: at(2 * time.Second).UnixMicro(), Valid: true}
	full, err := ops.TokenBucketCountFull(ctx, db, cut)
	require.NoError(t, err)
	require.Equal(t, int64(2), full)
	n, err = ops.TokenBucketDeleteFullBatchByKey(ctx, db, sqlops.TokenBucketDeleteFullBatchByKeyParams{
		AtUs: at(2 * time.Second).UnixMicro(), BatchSize: 100})
	require.NoError(t, err)
	require.Equal(t, int64(2), n)
	require.Empty(t, rows())

	// rl-cleanup's run, on the database clock: a slice taken now keeps its
	// row (its leases count for at least another second), the unleased
	// bucket of an hour ago goes.
	require.NoError(t, takeSlice(ctx, db, "leased", 6, capacity, refill, nil))
	hourAgo := time.Now().Add(-time.Hour)
	_, err = q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
		Key: []byte("plain"), Cost: 6, Capacity: capacity, RefillPerUs: refill, At: &hourAgo})
	require.NoError(t, err)
	res, err := cleanup.Run(ctx, db, cleanup.Options{})
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Tables.TokenBucket.Deleted)
	require.Equal(t, []string{"leased"}, rows())
}

// takeSlice takes a slice of up to n units of key's bucket at instant at
// (nil: now), as a lease takes one: a check statement of one slice.
func takeSlice(ctx context.Context, db sqlops.DBTX, key string, n int64, capacity, refill float64, at *time.Time) error {
	_, err := sqlops.New().TokenBucketTakeChecks(ctx, db, sqlops.TokenBucketTakeChecksParams{
		Keys: [][]byte{[]byte(key)}, Capacities: []float64{capacity}, RefillsPerUs: []float64{refill},
		Penalties: []bool{false}, Runs: []int32{1}, Ends: []int32{1}, Rows: []int32{1}, Costs: []int64{n},
		UpTo: []bool{true}, Vetoes: []bool{true}, Mins: []int64{1}, Shares: []int64{1}, At: at})
	return err
}
