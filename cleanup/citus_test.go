package cleanup_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

func requireCitus(t *testing.T) {
	t.Helper()
	if ok, err := migration.HasCitus(context.Background(), dbtest.Admin(t)); err != nil || !ok {
		t.Skip("the test database has no citus extension (see scripts/citus.sh)")
	}
}

// TestCitusDeleteModeByKey: on distributed tables, delete mode removes the
// dead rows of every table in batches (by primary key) and keeps the live.
func TestCitusDeleteModeByKey(t *testing.T) {
	requireCitus(t)
	db, _ := dbtest.Pool(t)
	ctx := context.Background()
	// Rows written by plain SQL: the checks' statements are not yet fit for
	// Citus (docs/SCALING.md, rule 3).
	for _, stmt := range []string{
		`INSERT INTO pgrl_fixed_window SELECT sha256(int8send(g)), now() - interval '1 hour', 1, true FROM generate_series(1, 37) g`,
		`INSERT INTO pgrl_fixed_window SELECT sha256(int8send(g)), now() + interval '1 hour', 1, true FROM generate_series(101, 111) g`,
		`INSERT INTO pgrl_token_bucket (key, tokens, updated_at, full_at, allowed) SELECT sha256(int8send(g)), 1, now() - interval '2 hours', now() - interval '1 hour', true FROM generate_series(1, 23) g`,
		`INSERT INTO pgrl_token_bucket (key, tokens, updated_at, full_at, allowed) SELECT sha256(int8send(g)), 1, now(), now() + interval '1 hour', true FROM generate_series(101, 107) g`,
		`INSERT INTO pgrl_sliding_window (key, window_start, prev_count, count, expires_at, allowed) SELECT sha256(int8send(g)), now() - interval '3 hours', 0, 1, now() - interval '1 hour', true FROM generate_series(1, 19) g`,
		`INSERT INTO pgrl_sliding_window (key, window_start, prev_count, count, expires_at, allowed) SELECT sha256(int8send(g)), now(), 0, 1, now() + interval '1 hour', true FROM generate_series(101, 105) g`,
	} {
		_, err := db.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	res, err := cleanup.Run(ctx, db, cleanup.Options{BatchSize: 10})
	require.NoError(t, err)
	require.Equal(t, int64(37), res.Tables.FixedWindow.Deleted)
	require.Equal(t, int64(23), res.Tables.TokenBucket.Deleted)
	require.Equal(t, int64(19), res.Tables.SlidingWindow.Deleted)
	require.Equal(t, 4, res.Tables.FixedWindow.Batches)
	require.Equal(t, int64(11), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
	require.Equal(t, int64(7), countRows(t, db, "SELECT count(*) FROM pgrl_token_bucket"))
	require.Equal(t, int64(5), countRows(t, db, "SELECT count(*) FROM pgrl_sliding_window"))
}

// TestCitusPartitionModeDetachesPlainly: with the fixed window partitioned
// (and distributed, by migration.SetLayout), partition mode drops the past
// partitions with a plain DETACH, which Citus accepts.
func TestCitusPartitionModeDetachesPlainly(t *testing.T) {
	requireCitus(t)
	ctx := context.Background()
	s := dbtest.NewSchema(t)
	m, err := migration.New(dbtest.URL(), migration.Config{Schema: s})
	require.NoError(t, err)
	defer func() { _ = m.Close() }()
	_, err = m.Up(ctx)
	require.NoError(t, err)
	db := dbtest.PoolOn(t, s)
	_, err = m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `SELECT pgrl_fixed_window_ensure_partitions(now() - interval '5 hours', now() - interval '3 hours')`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `INSERT INTO pgrl_fixed_window SELECT sha256(int8send(g)), now() - interval '4 hours', 1, true FROM generate_series(1, 321) g`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `INSERT INTO pgrl_fixed_window SELECT sha256(int8send(g)), now() + interval '10 minutes', 1, true FROM generate_series(1, 9) g`)
	require.NoError(t, err)

	res, err := cleanup.Run(ctx, db, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 3 * time.Hour})
	require.NoError(t, err)
	require.Equal(t, "plain", res.Partitions.Detach)
	require.Len(t, res.Partitions.Dropped, 3)
	require.Equal(t, int64(321), res.Partitions.RowsDropped)
	require.Equal(t, int64(9), countRows(t, db, "SELECT count(*) FROM pgrl_fixed_window"))
}
