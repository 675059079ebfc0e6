package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// The limit every case uses: so high that every check is admitted, so the
// statement always takes its update path and writes the row.
const (
	benchLimit  = 1_000_000_000
	benchWindow = time.Hour
	benchName   = "rl-bench"
)

// sliceTarget is the length the paths' alternating slices aim at.
const sliceTarget = 100 * time.Millisecond

// populateBatch is how many statements one round trip carries when every
// key is touched before the measurement.
const populateBatch = 1000

// workload is one algorithm's two paths over a set of keys.
type workload struct {
	algorithm ratelimit.Algorithm
	keys      []string // the library's keys
	hashed    [][]byte // the same keys as the raw statement sends them
	cfg       ratelimit.Config
	dbOpts    ratelimit.DatabaseOptions
	// requestIDs gives every library check a request id of its own
	// (--request-ids): nonce and a count, unique across runs.
	requestIDs bool
	// policy makes the library path read its limit from the stored policy
	// (--policy).
	policy bool
	// overrides is how many overrides of other keys the policy has
	// (--policy-overrides).
	overrides int
	// revision is the stored policy's overrides_revision once
	// storePolicy has written it, which the statement path sends.
	revision int64
	nonce    string
	count    *atomic.Int64
	// sqlCheck makes the library path the SQL function pgrl_check
	// (--sql-check), which counts under the name a policy's limiter
	// uses: the raw path's keys are stored under it too.
	sqlCheck bool
}

func newWorkload(a ratelimit.Algorithm, nkeys int, o options) workload {
	w := workload{
		algorithm: a,
		keys:      make([]string, nkeys),
		hashed:    make([][]byte, nkeys),
		cfg: ratelimit.Config{
			Name:      benchName,
			Algorithm: a,
			Limit:     benchLimit,
			Window:    benchWindow,
			Burst:     benchLimit,
			Spread:    o.spread,
		},
		dbOpts: ratelimit.DatabaseOptions{
			// Coalesced checks travel in a multi-key statement: the
			// raw path cannot send the same one. See --coalescing.
			DisableCoalescing: !o.coalescing,
			MaxInFlight:       o.maxInFlight,
		},
	}
	if o.policy {
		w.cfg.Policy, w.policy, w.overrides = benchName, true, o.policyOverrides
	}
	if o.requestIDs {
		w.requestIDs, w.nonce, w.count = true, strconv.FormatInt(time.Now().UnixNano(), 36)+"-", new(atomic.Int64)
	}
	counter := benchName
	if o.sqlCheck {
		w.sqlCheck = true
		if a != ratelimit.TokenBucket {
			counter = ratelimit.RateName(benchName, benchWindow)
		}
	}
	for i := range nkeys {
		w.keys[i] = "key-" + strconv.Itoa(i)
		w.hashed[i] = ratelimit.StoredKey(ratelimit.HashedKeys, counter, w.keys[i])
	}
	return w
}

// raw returns the raw path: the generated statement, with the parameters the
// library derives from the same Config, through db.
func (w workload) raw(db gen.DBTX) loadtest.Check {
	q := gen.New()
	windowUs := w.cfg.Window.Microseconds()
	switch w.algorithm {
	case ratelimit.TokenBucket:
		refill := float64(w.cfg.Limit) / float64(windowUs)
		return func(ctx context.Context, k int) error {
			_, err := q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
				Key: w.hashed[k], Cost: 1, Capacity: float64(w.cfg.Burst), RefillPerUs: refill,
			})
			return err
		}
	case ratelimit.SlidingWindow:
		return func(ctx context.Context, k int) error {
			_, err := q.SlidingWindowTake(ctx, db, gen.SlidingWindowTakeParams{
				Key: w.hashed[k], WindowUs: windowUs, Cost: 1, MaxCount: w.cfg.Limit,
			})
			return err
		}
	default:
		return func(ctx context.Context, k int) error {
			_, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
				Key: w.hashed[k], Cost: 1, MaxCount: w.cfg.Limit, WindowUs: windowUs,
			})
			return err
		}
	}
}

// statement returns the feature's own statement, sent directly with no
// library around it, or nil when the library path sends the raw statement
// itself: with --policy the take that reads the stored policy, with
// --request-ids the take that stores its answer under a fresh id, each
// with the figures the library would send for a lone check. Measured
// beside the other two, it splits the library path's ratio into what
// PostgreSQL charges for the feature (statement over raw) and what the
// client adds (library over statement).
func (w workload) statement(db gen.DBTX) loadtest.Check {
	if !w.policy && !w.requestIDs {
		return nil
	}
	q := sqlops.New()
	windowUs := w.cfg.Window.Microseconds()
	refill := float64(w.cfg.Limit) / float64(windowUs)
	if w.policy {
		// The library's statement for a key without an override: the
		// policy's row alone, guarded by the revision of its overrides'
		// keys (which the library reads at its first check).
		switch w.algorithm {
		case ratelimit.TokenBucket:
			return func(ctx context.Context, k int) error {
				_, err := q.TokenBucketTakeUnderPolicy(ctx, db, sqlops.TokenBucketTakeUnderPolicyParams{
					Key: w.hashed[k], Capacity: float64(w.cfg.Burst), Cost: 1, RefillPerUs: refill,
					Policy: benchName, KeyMode: "hashed", RateLimit: w.cfg.Limit, Burst: w.cfg.Burst, WindowUs: windowUs,
					OverridesRevision: w.revision,
				})
				return err
			}
		case ratelimit.SlidingWindow:
			return func(ctx context.Context, k int) error {
				_, err := q.SlidingWindowTakeUnderPolicy(ctx, db, sqlops.SlidingWindowTakeUnderPolicyParams{
					Key: w.hashed[k], WindowUs: windowUs, Cost: 1, MaxCount: w.cfg.Limit, Policy: benchName, KeyMode: "hashed",
					OverridesRevision: w.revision,
				})
				return err
			}
		default:
			return func(ctx context.Context, k int) error {
				_, err := q.FixedWindowTakeUnderPolicy(ctx, db, sqlops.FixedWindowTakeUnderPolicyParams{
					Key: w.hashed[k], WindowUs: windowUs, Cost: 1, MaxCount: w.cfg.Limit, Policy: benchName, KeyMode: "hashed",
					OverridesRevision: w.revision,
				})
				return err
			}
		}
	}
	// A request id the library path never uses: "s" marks this path's.
	id := func() []byte {
		sum := sha256.Sum256([]byte(w.nonce + "s" + strconv.FormatInt(w.count.Add(1), 10)))
		return sum[:16]
	}
	switch w.algorithm {
	case ratelimit.TokenBucket:
		return func(ctx context.Context, k int) error {
			_, err := q.TokenBucketTakeOnce(ctx, db, sqlops.TokenBucketTakeOnceParams{
				Key: w.hashed[k], Capacity: float64(w.cfg.Burst), Cost: 1, RefillPerUs: refill,
				RequestKey: w.hashed[k], RequestID: id(), RetainUs: windowUs,
			})
			return err
		}
	case ratelimit.SlidingWindow:
		return func(ctx context.Context, k int) error {
			_, err := q.SlidingWindowTakeOnce(ctx, db, sqlops.SlidingWindowTakeOnceParams{
				Key: w.hashed[k], WindowUs: windowUs, Cost: 1, MaxCount: w.cfg.Limit,
				RequestKey: w.hashed[k], RequestID: id(), RetainUs: windowUs,
			})
			return err
		}
	default:
		return func(ctx context.Context, k int) error {
			_, err := q.FixedWindowTakeOnce(ctx, db, sqlops.FixedWindowTakeOnceParams{
				Key: w.hashed[k], WindowUs: windowUs, Cost: 1, MaxCount: w.cfg.Limit,
				RequestKey: w.hashed[k], RequestID: id(), RetainUs: windowUs,
			})
			return err
		}
	}
}

// library returns the library path: Limiter.Allow on db, or with
// --sql-check the SQL function pgrl_check.
func (w workload) library(db ratelimit.DB) (loadtest.Check, error) {
	if w.sqlCheck {
		return func(ctx context.Context, k int) error {
			var allowed bool
			err := db.QueryRow(ctx, "SELECT allowed FROM pgrl_check($1, $2)", benchName, w.keys[k]).Scan(&allowed)
			if err == nil && !allowed {
				return fmt.Errorf("check of %q denied with a limit of %d: the benchmark measures admitted checks", w.keys[k], benchLimit)
			}
			return err
		}, nil
	}
	rdb, err := ratelimit.NewDatabase(db, w.dbOpts)
	if err != nil {
		return nil, err
	}
	l, err := rdb.Limiter(w.cfg)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context, k int) error {
		var opts []ratelimit.Option
		if w.requestIDs {
			opts = []ratelimit.Option{ratelimit.RequestID(w.nonce + strconv.FormatInt(w.count.Add(1), 10))}
		}
		d, err := l.Allow(ctx, w.keys[k], opts...)
		if err == nil && !d.Allowed {
			return fmt.Errorf("check of %q denied with a limit of %d: the benchmark measures admitted checks", w.keys[k], benchLimit)
		}
		return err
	}, nil
}

// storePolicy writes the workload's figures as the policy its library path
// reads (--policy), with --policy-overrides overrides of other keys (by
// default 1,000, so that the override lookup searches a populated index),
// and no other.
func (w *workload) storePolicy(ctx context.Context, db gen.DBTX) error {
	_, err := db.Exec(ctx, `
INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst)
VALUES ($1, $2, $3, $4 * interval '1 microsecond', $5)
ON CONFLICT (name) DO UPDATE SET algorithm = excluded.algorithm, "limit" = excluded."limit",
       "window" = excluded."window", burst = excluded.burst`,
		benchName, string(w.algorithm), w.cfg.Limit, w.cfg.Window.Microseconds(), w.cfg.Burst)
	if err != nil {
		return fmt.Errorf("store the benchmark's policy: %w", err)
	}
	_, err = db.Exec(ctx, `
WITH gone AS (
    DELETE FROM pgrl_policy_override WHERE policy = $1 AND key <> ALL (
        SELECT pgrl_stored_key($1, 'override-' || i) FROM generate_series(1, $3::int) AS i)
)
INSERT INTO pgrl_policy_override (policy, key, "limit", note)
SELECT $1, pgrl_stored_key($1, 'override-' || i), $2, 'rl-bench'
  FROM generate_series(1, $3::int) AS i
ON CONFLICT (policy, key) DO NOTHING`, benchName, w.cfg.Limit, w.overrides)
	if err != nil {
		return fmt.Errorf("store the benchmark's overrides: %w", err)
	}
	// Every run rewrites the policy's row: without a vacuum (autovacuum may
	// be off, or not yet around) each check's lookup would walk one more
	// dead version of it per run, and the ratio would drift from run to run.
	if _, err = db.Exec(ctx, `VACUUM pgrl_policy, pgrl_policy_override`); err != nil {
		return fmt.Errorf("vacuum the benchmark's policy tables: %w", err)
	}
	if err = db.QueryRow(ctx, `SELECT overrides_revision FROM pgrl_policy WHERE name = $1`, benchName).Scan(&w.revision); err != nil {
		return fmt.Errorf("read the benchmark's policy: %w", err)
	}
	return nil
}

// populate touches every key once, so that the measured checks update
// existing rows. It sends the raw statement in batches.
func (w workload) populate(ctx context.Context, pool *pgxpool.Pool) error {
	for start := 0; start < len(w.keys); start += populateBatch {
		b := &pgx.Batch{}
		check := w.raw(batchDB{b})
		for k := start; k < min(start+populateBatch, len(w.keys)); k++ {
			if err := check(ctx, k); err != nil {
				return err
			}
		}
		if err := pool.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("populate %s keys: %w", w.algorithm, err)
		}
	}
	return nil
}

// batchDB queues the statements that generated code sends into a batch.
// Results are discarded: QueryRow's row scans nothing.
type batchDB struct{ b *pgx.Batch }

func (d batchDB) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	d.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (d batchDB) Query(context.Context, string, ...any) (pgx.Rows, error) {
	return nil, errors.New("rl-bench: Query is not batched")
}

func (d batchDB) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	d.b.Queue(sql, args...)
	return discardRow{}
}

type discardRow struct{}

func (discardRow) Scan(...any) error { return nil }

// openPool opens a pool of n connections on the benchmark's schema and
// establishes all of them.
func openPool(ctx context.Context, connString, schema string, n int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("invalid connection string: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "rl-bench"
	}
	return cli.OpenPool(ctx, cfg, n)
}

// runCase measures both paths of one algorithm at one number of callers
// over nkeys keys.
func runCase(ctx context.Context, o options, connString string, w workload, callers, nkeys int) (Case, error) {
	pool, err := openPool(ctx, connString, o.schema, callers)
	if err != nil {
		return Case{}, err
	}
	defer pool.Close()
	libCheck, err := w.library(pool)
	if err != nil {
		return Case{}, err
	}
	raw := &loadtest.Path{Name: "raw", Check: w.raw(pool)}
	lib := &loadtest.Path{Name: "library", Check: libCheck}
	paths := []*loadtest.Path{raw, lib}
	var stmt *loadtest.Path
	if check := w.statement(pool); check != nil {
		stmt = &loadtest.Path{Name: "statement", Check: check}
		paths = append(paths, stmt)
	}
	plan := loadtest.Plan{Callers: callers, Keys: nkeys, Warmup: o.warmup, Duration: o.duration, Slice: sliceTarget}
	// The paths take turns at going first, so that none always runs right
	// after the same other.
	if err := loadtest.Run(ctx, plan, paths...); err != nil {
		return Case{}, err
	}
	c := Case{
		Algorithm:        string(w.algorithm),
		Callers:          callers,
		Keys:             nkeys,
		RawChecks:        raw.Checks(),
		LibraryChecks:    lib.Checks(),
		RawOpsPerSec:     loadtest.Round(raw.OpsPerSec(), 1),
		LibraryOpsPerSec: loadtest.Round(lib.OpsPerSec(), 1),
		RawP50Us:         loadtest.Round(raw.PercentileUs(0.50), 1),
		LibraryP50Us:     loadtest.Round(lib.PercentileUs(0.50), 1),
		RawP99Us:         loadtest.Round(raw.PercentileUs(0.99), 1),
		LibraryP99Us:     loadtest.Round(lib.PercentileUs(0.99), 1),
	}
	c.ThroughputRatio = loadtest.Ratio(lib.OpsPerSec(), raw.OpsPerSec())
	c.P50Ratio = loadtest.Ratio(lib.PercentileUs(0.50), raw.PercentileUs(0.50))
	c.P99Ratio = loadtest.Ratio(lib.PercentileUs(0.99), raw.PercentileUs(0.99))
	if stmt != nil {
		c.StatementChecks = stmt.Checks()
		c.StatementOpsPerSec = loadtest.Round(stmt.OpsPerSec(), 1)
		c.StatementP50Us = loadtest.Round(stmt.PercentileUs(0.50), 1)
		c.StatementP99Us = loadtest.Round(stmt.PercentileUs(0.99), 1)
		c.StatementP50Ratio = loadtest.Ratio(stmt.PercentileUs(0.50), raw.PercentileUs(0.50))
		c.LibraryOverStatementP50 = loadtest.Ratio(lib.PercentileUs(0.50), stmt.PercentileUs(0.50))
	}
	return c, nil
}

// benchmark runs every case and gathers the report.
func benchmark(ctx context.Context, o options, connString string, log io.Writer) (Report, error) {
	cfg, err := cli.ParseConfig(connString, "rl-bench")
	if err != nil {
		return Report{}, err
	}
	m, err := migration.NewWithConnConfig(cfg, migration.Config{Schema: o.schema})
	if err != nil {
		return Report{}, err
	}
	res, err := m.Up(ctx)
	_ = m.Close()
	if err != nil {
		return Report{}, fmt.Errorf("migrate schema %s: %w", o.schema, err)
	}
	if res.Changed() {
		fmt.Fprintf(log, "rl-bench: migrated schema %s to version %d\n", o.schema, res.To)
	}

	admin, err := cli.Connect(ctx, cfg, map[string]string{"search_path": pgx.Identifier{o.schema}.Sanitize()})
	if err != nil {
		return Report{}, err
	}
	defer func() { _ = admin.Close(context.Background()) }()
	rep := Report{
		Machine: Machine{
			GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, NumCPU: runtime.NumCPU(), GoVersion: runtime.Version(),
		},
		Schema:          o.schema,
		DurationSeconds: o.duration.Seconds(),
		WarmupSeconds:   o.warmup.Seconds(),
		Limit:           benchLimit,
		Coalescing:      o.coalescing,
		Policy:          o.policy,
		RequestIDs:      o.requestIDs,
		SQLCheck:        o.sqlCheck,
		Concurrency:     o.concurrency,
		MaxInFlight:     o.maxInFlight,
		Window:          benchWindow.String(),
		Targets:         defaultTargets,
	}
	if o.policy {
		rep.PolicyOverrides = &o.policyOverrides
	}
	var versionNum int
	var autovacuum bool
	if err := admin.QueryRow(ctx, "SELECT current_setting('server_version'), current_setting('server_version_num')::int, "+
		"current_setting('autovacuum')::boolean").Scan(&rep.Machine.ServerVersion, &versionNum, &autovacuum); err != nil {
		return rep, err
	}
	rep.Machine.AutovacuumOff = !autovacuum
	before, err := tableStats(ctx, admin, o.schema)
	if err != nil {
		return rep, err
	}

	algorithms := o.algorithms
	if o.concurrency {
		// An acquire against the fixed-window check, instead of the
		// algorithms' raw and library paths.
		algorithms = nil
		rep.ConcurrencyLimit, rep.ConcurrencyWindow = concurrencyLimit, concurrencyLease.String()
		if err := benchmarkConcurrency(ctx, o, connString, admin, versionNum, &rep, log); err != nil {
			return rep, err
		}
	}
	maxKeys := slices.Max(o.keys)
	for _, a := range algorithms {
		w := newWorkload(a, maxKeys, o)
		pool, err := openPool(ctx, connString, o.schema, 1)
		if err != nil {
			return rep, err
		}
		fmt.Fprintf(log, "rl-bench: %s: touching %d keys\n", a, maxKeys)
		err = w.populate(ctx, pool)
		if err == nil && (o.policy || o.sqlCheck) {
			err = w.storePolicy(ctx, pool)
		}
		pool.Close()
		if err != nil {
			return rep, err
		}
		for _, callers := range o.callers {
			for _, nkeys := range o.keys {
				fmt.Fprintf(log, "rl-bench: %s, %d callers, %d keys: raw and library, %v each\n", a, callers, nkeys, o.duration)
				c, err := runCase(ctx, o, connString, w, callers, nkeys)
				if err != nil {
					return rep, fmt.Errorf("%s, %d callers, %d keys: %w", a, callers, nkeys, err)
				}
				rep.Cases = append(rep.Cases, c)
			}
		}
	}

	after, err := settledTableStats(ctx, admin, o.schema, versionNum)
	if err != nil {
		return rep, err
	}
	rep.HotUpdateRatio, rep.TableUpdates = hotRatios(before, after)
	rep.TargetsMet, rep.TargetMisses = rep.Targets.check(rep)
	return rep, nil
}
