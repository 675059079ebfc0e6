package cleanup_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// insertSlots inserts n rows of pgrl_concurrency, keys prefix-1 to
// prefix-n, each holding one slot that lapses (and a row whose expires_at
// is) the database clock plus in: dead rows for a negative in, rows holding
// a live slot for a positive one.
func insertSlots(t testing.TB, db *pgxpool.Pool, prefix string, n int, in time.Duration) {
	t.Helper()
	_, err := db.Exec(context.Background(), `
		INSERT INTO pgrl_concurrency (key, slots, expires_at, updated_at)
		SELECT convert_to($1 || '-' || g, 'UTF8'),
		       ARRAY[ROW(sha256(convert_to($1 || g, 'UTF8')), pgrl_epoch_us(x.e))::pgrl_slot], x.e,
		       statement_timestamp() - interval '2 hours'
		  FROM generate_series(1, $2::integer) AS g,
		       LATERAL (SELECT statement_timestamp() + $3::bigint * interval '1 microsecond' AS e) AS x`,
		prefix, n, in.Microseconds())
	require.NoError(t, err)
}

func newToken(t testing.TB) []byte {
	t.Helper()
	tok := make([]byte, 16)
	_, err := rand.Read(tok)
	require.NoError(t, err)
	return tok
}

// acquireRaw takes a slot of key for a fresh token with the acquire
// statement itself, at the pinned instant at (nil: the database clock),
// for a lease of ttl. It returns the token.
func acquireRaw(t testing.TB, db gen.DBTX, key string, at *time.Time, ttl time.Duration) []byte {
	t.Helper()
	tok := newToken(t)
	r, err := q.ConcurrencyAcquire(context.Background(), db, gen.ConcurrencyAcquireParams{
		Key: []byte(key), Token: tok, At: at, TtlUs: ttl.Microseconds(), MaxHeld: 1000,
	})
	require.NoError(t, err)
	require.True(t, r.Allowed, key)
	return tok
}

// TestConcurrencyDeletesLapsedRowsKeepsHeldSlots: delete mode (and its dry
// run) removes the rows of concurrency limits whose every slot has lapsed,
// and keeps every row whose expires_at is ahead: a slot held through the
// library, a key with a lapsed slot beside a live one, and a key whose slot
// was released but whose expires_at has not come (dead at it, not before).
func TestConcurrencyDeletesLapsedRowsKeepsHeldSlots(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := dbtest.Pool(t)

	// 23 keys whose slots, taken two hours ago for a minute, have lapsed.
	past := time.Now().Add(-2 * time.Hour)
	for i := range 23 {
		acquireRaw(t, db, fmt.Sprintf("dead-%02d", i), &past, time.Minute)
	}
	// A key with a lapsed slot and a live one.
	acquireRaw(t, db, "mixed", &past, time.Minute)
	mixed := acquireRaw(t, db, "mixed", nil, time.Hour)
	// A slot held through the library, whose lease its Database extends.
	l := testkit.NewLimiter(t, db, ratelimit.Config{Name: "held", Algorithm: ratelimit.Concurrency, Limit: 1, Window: 30 * time.Second})
	slot, d, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Equal(t, ratelimit.StorePostgres, d.Store)
	defer func() { require.NoError(t, slot.Release(context.WithoutCancel(ctx))) }()
	// A key whose only slot was released: it holds nothing, but its row's
	// expires_at (the released slot's lapse) is two hours ahead.
	released := acquireRaw(t, db, "released", nil, 2*time.Hour)
	n, err := q.ConcurrencyRelease(ctx, db, gen.ConcurrencyReleaseParams{Key: []byte("released"), Token: released})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, int64(26), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))

	res, err := cleanup.Run(ctx, db, cleanup.Options{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, cleanup.TableResult{WouldDelete: 23}, res.Tables.Concurrency)
	require.Equal(t, int64(26), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))

	res, err = cleanup.Run(ctx, db, cleanup.Options{BatchSize: 10})
	require.NoError(t, err)
	require.Equal(t, cleanup.TableResult{Deleted: 23, Batches: 3}, res.Tables.Concurrency)
	require.Equal(t, int64(3), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
	require.Zero(t, countRows(t, db, "SELECT count(*) FROM pgrl_concurrency WHERE substr(key, 1, 5) = convert_to('dead-', 'UTF8')"))

	// The slots held are held still: the library's slot is live, refuses a
	// second holder (Limit 1), and the mixed key's live slot is there.
	require.NoError(t, slot.Err())
	other, d, err := l.Acquire(ctx, "k")
	require.NoError(t, err)
	require.False(t, d.Allowed, "the held slot survived the cleanup: a second acquire of Limit 1 is refused")
	require.Nil(t, other)
	peek, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(1), peek.Used)
	var holds bool
	require.NoError(t, db.QueryRow(ctx, `SELECT pgrl_concurrency_holds(slots, pgrl_now_us(NULL), $1)
		FROM pgrl_concurrency WHERE key = 'mixed'`, mixed).Scan(&holds))
	require.True(t, holds)

	// The released key's row is dead at its expires_at, not a microsecond
	// before (a slot lapses at its until_us); the other two, whose slots
	// lapse sooner, are dead at both instants.
	var expires time.Time
	require.NoError(t, db.QueryRow(ctx, "SELECT expires_at FROM pgrl_concurrency WHERE key = 'released'").Scan(&expires))
	before := expires.Add(-time.Microsecond)
	res, err = cleanup.Run(ctx, db, cleanup.Options{DryRun: true, At: &before})
	require.NoError(t, err)
	require.Equal(t, int64(2), res.Tables.Concurrency.WouldDelete)
	res, err = cleanup.Run(ctx, db, cleanup.Options{DryRun: true, At: &expires})
	require.NoError(t, err)
	require.Equal(t, int64(3), res.Tables.Concurrency.WouldDelete)
}

// TestConcurrencyCleanupRacesAcquires: acquires that take slots of dead
// rows while the cleanup deletes them never lose their slot. An acquire
// that writes a row after a batch chose it raises its expires_at, and the
// batch, rechecking the row's latest version, leaves it; one that comes
// after the delete makes the row anew.
func TestConcurrencyCleanupRacesAcquires(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := dbtest.Pool(t, dbtest.WithMaxConns(6))
	const dead = 5000
	insertSlots(t, db, "race", dead, -time.Hour)

	type held struct{ key, token []byte }
	var (
		mu    sync.Mutex
		taken []held
		done  = make(chan struct{})
		wg    sync.WaitGroup
		n     atomic.Int64
	)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ; i += 4 {
				select {
				case <-done:
					return
				default:
				}
				key := []byte(fmt.Sprintf("race-%d", 1+(i*7919)%dead))
				tok := make([]byte, 16)
				_, _ = rand.Read(tok)
				r, err := q.ConcurrencyAcquire(ctx, db, gen.ConcurrencyAcquireParams{
					Key: key, Token: tok, TtlUs: time.Hour.Microseconds(), MaxHeld: 1000,
				})
				if err != nil {
					t.Errorf("acquire during cleanup: %v", err)
					return
				}
				if !r.Allowed {
					t.Errorf("acquire of %s refused", key)
					return
				}
				mu.Lock()
				taken = append(taken, held{key, tok})
				mu.Unlock()
				n.Add(1)
			}
		}()
	}
	require.Eventually(t, func() bool { return n.Load() >= 50 }, 30*time.Second, time.Millisecond)
	// A batch that meets a row an acquire revived meanwhile deletes fewer
	// rows than its size, which ends the run early: run again until a run
	// finds nothing dead, with the acquires still going.
	var deleted int64
	var runs, batches int
	from := n.Load()
	for {
		res, err := cleanup.Run(ctx, db, cleanup.Options{BatchSize: 50, LockTimeout: 10 * time.Second})
		require.NoError(t, err)
		runs++
		deleted += res.Tables.Concurrency.Deleted
		batches += res.Tables.Concurrency.Batches
		if res.Tables.Concurrency.Deleted == 0 || runs == 1000 {
			break
		}
	}
	during := n.Load() - from
	close(done)
	wg.Wait()
	require.Positive(t, during, "acquires ran while the batches did")

	keys, tokens := make([][]byte, len(taken)), make([][]byte, len(taken))
	distinct := map[string]bool{}
	for i, h := range taken {
		keys[i], tokens[i] = h.key, h.token
		distinct[string(h.key)] = true
	}
	var live int64
	require.NoError(t, db.QueryRow(ctx, `
		SELECT count(*) FROM unnest($1::bytea[], $2::bytea[]) AS p(key, token)
		  JOIN pgrl_concurrency AS c ON c.key = p.key
		 WHERE pgrl_concurrency_holds(c.slots, pgrl_now_us(NULL), p.token)`, keys, tokens).Scan(&live))
	require.Equal(t, int64(len(taken)), live, "every slot taken during the cleanup is held after it")
	// What is left is the rows of the keys taken, every one live; the
	// cleanup deleted the others, and some of the taken ones before they
	// were taken.
	require.Equal(t, int64(len(distinct)), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
	require.Zero(t, countRows(t, db, "SELECT count(*) FROM pgrl_concurrency WHERE expires_at <= now()"))
	require.GreaterOrEqual(t, deleted, int64(dead-len(distinct)))
	require.LessOrEqual(t, deleted, int64(dead))
	t.Logf("%d acquires on %d keys, %d of them during %d cleanup runs that deleted %d rows in %d batches",
		len(taken), len(distinct), during, runs, deleted, batches)
}

// TestConcurrencyCleanupOnOlderSchemas: a schema migrated only up to a
// version before pgrl_concurrency (000019), or before pgrl_request
// (000017) too, is cleaned as before, in both the real and the dry run.
func TestConcurrencyCleanupOnOlderSchemas(t *testing.T) {
	t.Parallel()
	for _, version := range []uint{16, 18} {
		t.Run(fmt.Sprint(version), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			s := dbtest.NewSchema(t)
			m, err := migration.New(dbtest.URL(), migration.Config{Schema: s})
			require.NoError(t, err)
			_, err = m.UpTo(ctx, version)
			require.NoError(t, m.Close())
			require.NoError(t, err)
			db := dbtest.PoolOn(t, s)
			require.Zero(t, countRows(t, db, "SELECT count(*) FROM pg_class WHERE oid = to_regclass('pgrl_concurrency')"))
			insertExpired(t, db, 7)

			res, err := cleanup.Run(ctx, db, cleanup.Options{DryRun: true})
			require.NoError(t, err)
			require.Equal(t, int64(7), res.Tables.FixedWindow.WouldDelete)
			require.Equal(t, cleanup.TableResult{}, res.Tables.Concurrency)
			res, err = cleanup.Run(ctx, db, cleanup.Options{})
			require.NoError(t, err)
			require.Equal(t, int64(7), res.Tables.FixedWindow.Deleted)
			require.Equal(t, cleanup.TableResult{}, res.Tables.Concurrency)
			// One batch of each table the schema has, none of those it lacks.
			batches, requests := 3, cleanup.TableResult{}
			if version >= 17 {
				batches, requests = 4, cleanup.TableResult{Batches: 1}
			}
			require.Equal(t, requests, res.Tables.Requests)
			require.Equal(t, batches, res.Batches)
		})
	}
}

// TestConcurrencyWithoutGrantIsLeftAloneWithAWarning: a cleanup role
// granted the tables before migration 000019 (SELECT and DELETE on the
// counters and pgrl_request only) keeps cleaning them; pgrl_concurrency is
// left alone with a warning that names the grant, and cleaned once the
// grant is given.
func TestConcurrencyWithoutGrantIsLeftAloneWithAWarning(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, s := dbtest.Pool(t)
	role := dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	schema, roleID := pgx.Identifier{s}.Sanitize(), pgx.Identifier{role}.Sanitize()
	for _, stmt := range []string{
		"GRANT USAGE ON SCHEMA " + schema + " TO " + roleID,
		"GRANT SELECT, DELETE ON " + schema + ".pgrl_fixed_window, " + schema + ".pgrl_token_bucket, " +
			schema + ".pgrl_sliding_window, " + schema + ".pgrl_request TO " + roleID,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	insertExpired(t, db, 5)
	insertSlots(t, db, "lapsed", 9, -time.Hour)
	app, err := pgxpool.New(ctx, dbtest.URLAsWithSchema(role, s))
	require.NoError(t, err)
	t.Cleanup(app.Close)

	var logs testkit.LogBuffer
	logger := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	res, err := cleanup.Run(ctx, app, cleanup.Options{Logger: logger})
	require.NoError(t, err)
	require.Equal(t, int64(5), res.Tables.FixedWindow.Deleted)
	require.Equal(t, cleanup.TableResult{}, res.Tables.Concurrency)
	require.Equal(t, int64(9), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
	var warning struct{ Msg, Fix string }
	require.NoError(t, json.Unmarshal([]byte(logs.String()), &warning), logs.String())
	require.Contains(t, warning.Msg, "cleanup left pgrl_concurrency alone")
	require.Equal(t, "GRANT SELECT, DELETE ON "+pgx.Identifier{s, "pgrl_concurrency"}.Sanitize()+" TO "+roleID, warning.Fix)

	_, err = admin.Exec(ctx, "GRANT SELECT, DELETE ON "+schema+".pgrl_concurrency TO "+roleID)
	require.NoError(t, err)
	res, err = cleanup.Run(ctx, app, cleanup.Options{})
	require.NoError(t, err)
	require.Equal(t, cleanup.TableResult{Deleted: 9, Batches: 1}, res.Tables.Concurrency)
	require.Zero(t, countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
}

// TestConcurrencyDeleteByKeyKeepsLiveRows: the primary-key batches that
// Citus runs delete the same rows as the ctid ones, and no live row.
func TestConcurrencyDeleteByKeyKeepsLiveRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := dbtest.Pool(t)
	insertSlots(t, db, "lapsed", 25, -time.Hour)
	insertSlots(t, db, "held", 4, time.Hour)
	var total int64
	batches := 0
	for {
		n, err := ops.ConcurrencyDeleteExpiredBatchByKey(ctx, db, sqlops.ConcurrencyDeleteExpiredBatchByKeyParams{
			AtUs: time.Now().UnixMicro(), BatchSize: 10,
		})
		require.NoError(t, err)
		total += n
		batches++
		if n < 10 {
			break
		}
	}
	require.Equal(t, int64(25), total)
	require.Equal(t, 3, batches)
	require.Equal(t, int64(4), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency WHERE expires_at > now()"))
	require.Equal(t, int64(4), countRows(t, db, "SELECT count(*) FROM pgrl_concurrency"))
}
