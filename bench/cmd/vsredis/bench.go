package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

// The limit both sides enforce: one unit a second of refill and a burst of
// 1e9, so that every check is admitted and no key's state ever expires
// during a run (redis_rate's key TTL is the time until the bucket is full
// again, which only grows here).
const (
	benchName  = "vsredis"
	benchRate  = 1
	benchBurst = 1_000_000_000
)

// redisLimit is benchRate/benchBurst in redis_rate's terms.
var redisLimit = redis_rate.Limit{Rate: benchRate, Period: time.Second, Burst: benchBurst}

// sliceTarget is the length the paths' alternating slices aim at.
const sliceTarget = 250 * time.Millisecond

// populateCallers is how many goroutines touch every key before the cases.
const populateCallers = 64

// Path names, as in the report.
const (
	pathPgrl        = "pgrl"
	pathRedis       = "redis_rate"
	pathUncoalesced = "pgrl_uncoalesced"
)

// countingDB passes pgrl's statements to the pool and counts them: the
// library sends a lone check with QueryRow, and a coalesced batch, which
// may carry multi-limit decisions (AllowAll) of one algorithm, with Query;
// earlier versions sent a multi-limit decision as a pgx.Batch of several
// statements in one round trip, which it counts too.
type countingDB struct {
	pool    *pgxpool.Pool
	single  atomic.Int64
	many    atomic.Int64
	batches atomic.Int64 // pgx.Batch round trips
	batched atomic.Int64 // statements in them
}

func (d *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return d.pool.Exec(ctx, sql, args...)
}

func (d *countingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	d.many.Add(1)
	return d.pool.Query(ctx, sql, args...)
}

// SendBatch sends b in one round trip.
func (d *countingDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	d.batches.Add(1)
	d.batched.Add(int64(b.Len()))
	return d.pool.SendBatch(ctx, b)
}

func (d *countingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	d.single.Add(1)
	return d.pool.QueryRow(ctx, sql, args...)
}

// path is one way of deciding checks, with what it measured besides
// latency: it is its own loadtest.Meter.
type path struct {
	loadtest.Path
	db *countingDB // pgrl paths only
	// serverCPU reads the CPU time used so far by the server processes
	// that the path talks to: the pool's PostgreSQL backends, or
	// redis-server.
	serverCPU func(ctx context.Context) time.Duration

	cpu    time.Duration // client CPU (user + system) while it ran
	busy   cpuSample     // machine CPU while it ran
	server time.Duration // CPU of the store's server processes while it ran
	single int64
	many   int64
	// batches and batched: pgx.Batch round trips and their statements.
	batches, batched int64

	// tally counts the checks of the mix's paths, whose requests make one
	// check or several; nil for the other paths (one check per call).
	tally *checkTally
	// checks and pgChecks are what tally counted in the measured slices.
	checks, pgChecks int64

	start reading // at the start of the current slice
}

// reading is what a path's meter reads at the start and end of a slice.
type reading struct {
	server, cpu      time.Duration
	busy             cpuSample
	single, many     int64
	batches, batched int64
	checks, pgChecks int64
}

func newPath(name string, check loadtest.Check, db *countingDB) *path {
	p := &path{db: db}
	p.Path = loadtest.Path{Name: name, Check: check, Meter: p}
	return p
}

func (p *path) read(ctx context.Context) reading {
	r := reading{server: p.serverCPU(ctx)}
	if p.db != nil {
		r.single, r.many = p.db.single.Load(), p.db.many.Load()
		r.batches, r.batched = p.db.batches.Load(), p.db.batched.Load()
	}
	if p.tally != nil {
		r.checks, r.pgChecks = p.tally.checks.Load(), p.tally.pg.Load()
	}
	r.cpu = processCPU()
	r.busy = readCPU()
	return r
}

// Start implements loadtest.Meter.
func (p *path) Start(ctx context.Context) { p.start = p.read(ctx) }

// Stop implements loadtest.Meter: it adds what was used since Start.
func (p *path) Stop(ctx context.Context, measured bool) {
	cpu := processCPU() - p.start.cpu
	busy := readCPU().sub(p.start.busy)
	server := p.serverCPU(ctx) - p.start.server
	if !measured {
		return
	}
	p.cpu += cpu
	p.busy = p.busy.add(busy)
	p.server += server
	if p.db != nil {
		p.single += p.db.single.Load() - p.start.single
		p.many += p.db.many.Load() - p.start.many
		p.batches += p.db.batches.Load() - p.start.batches
		p.batched += p.db.batched.Load() - p.start.batched
	}
	if p.tally != nil {
		p.checks += p.tally.checks.Load() - p.start.checks
		p.pgChecks += p.tally.pg.Load() - p.start.pgChecks
	}
}

// checkTally counts the checks a mix path made, and of them those that
// PostgreSQL decided.
type checkTally struct {
	checks, pg atomic.Int64
}

// keyName is the key both limiters see for key number k.
func keyName(k int) string { return "key-" + strconv.Itoa(k) }

// pgrlConfig is the limit pgrl enforces: a token bucket like redis_rate's
// GCRA, refilling benchRate a second up to benchBurst.
//
// With --algorithm fixed_window or sliding_window it is benchBurst per
// window of a second instead: every check is admitted as well.
func pgrlConfig(o options) ratelimit.Config {
	if a := algorithmOf(o); a != ratelimit.TokenBucket {
		return ratelimit.Config{
			Name:      benchName,
			Algorithm: a,
			Limit:     benchBurst,
			Window:    time.Second,
			OnFailure: ratelimit.FailError,
		}
	}
	return ratelimit.Config{
		Name:      benchName,
		Algorithm: ratelimit.TokenBucket,
		Limit:     benchRate,
		Window:    time.Second,
		Burst:     benchBurst,
		OnFailure: ratelimit.FailError, // an error must stop the run, not be answered from memory
	}
}

// algorithmOf is pgrl's algorithm in the run (the token bucket unless
// --algorithm says otherwise).
func algorithmOf(o options) ratelimit.Algorithm {
	if o.algorithm == "" {
		return ratelimit.TokenBucket
	}
	return o.algorithm
}

// pgrlOptions are the options of the Database pgrl's limits are kept in:
// the coalescer's settings of the run.
func pgrlOptions(o options, disableCoalescing bool) ratelimit.DatabaseOptions {
	return ratelimit.DatabaseOptions{
		DisableCoalescing: disableCoalescing,
		MaxBatch:          o.maxBatch,
		MaxInFlight:       o.maxInFlight,
	}
}

// pgrlLimiter is the limit pgrl enforces, on a Database of its own on db
// (a pool, or a wrapper of one) with pgrlOptions.
func pgrlLimiter(db ratelimit.DB, o options, disableCoalescing bool) (*ratelimit.Limiter, error) {
	d, err := ratelimit.NewDatabase(db, pgrlOptions(o, disableCoalescing))
	if err != nil {
		return nil, err
	}
	return d.Limiter(pgrlConfig(o))
}

func pgrlCheck(l *ratelimit.Limiter, keys []string) loadtest.Check {
	return func(ctx context.Context, k int) error {
		d, err := l.Allow(ctx, keys[k])
		if err != nil {
			return err
		}
		if !d.Allowed || d.Store != ratelimit.StorePostgres {
			return fmt.Errorf("check of %q: allowed=%v store=%v: the benchmark measures admitted checks decided by PostgreSQL", keys[k], d.Allowed, d.Store)
		}
		return nil
	}
}

func redisCheck(l *redis_rate.Limiter, keys []string) loadtest.Check {
	return func(ctx context.Context, k int) error {
		res, err := l.Allow(ctx, keys[k], redisLimit)
		if err != nil {
			return err
		}
		if res.Allowed != 1 {
			return fmt.Errorf("check of %q denied: the benchmark measures admitted checks", keys[k])
		}
		return nil
	}
}

// openPool opens a pool of n connections on the schema and establishes all
// of them. The backends are found by their application_name (serverCPU).
func openPool(ctx context.Context, connString, schema string, n int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("invalid connection string: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	cfg.ConnConfig.RuntimeParams["application_name"] = "vsredis"
	return cli.OpenPool(ctx, cfg, n)
}

// openRedis returns a client with a pool of n connections, all established.
func openRedis(ctx context.Context, o options, n int) (*redis.Client, error) {
	rdb := redis.NewClient(&redis.Options{
		Addr:         o.redisAddr,
		DB:           o.redisDB,
		PoolSize:     n,
		MinIdleConns: n,
	})
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = rdb.Ping(ctx).Err()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		_ = rdb.Close()
		return nil, fmt.Errorf("redis at %s: %w", o.redisAddr, err)
	}
	return rdb, nil
}

// pgConnsFor is the pgx pool size of a case.
func pgConnsFor(o options, callers int) int {
	if o.pgConns > 0 {
		return o.pgConns
	}
	return min(callers, 16)
}

// redisConnsFor is the go-redis pool size of a case: go-redis's default
// (10 per GOMAXPROCS), and never fewer than the callers.
func redisConnsFor(callers int) int {
	return max(callers, 10*runtime.GOMAXPROCS(0))
}

// runCase measures every path at one number of callers over nkeys keys.
func runCase(ctx context.Context, o options, keys []string, callers, nkeys int) (Case, error) {
	pool, err := openPool(ctx, o.databaseURL, o.schema, pgConnsFor(o, callers))
	if err != nil {
		return Case{}, err
	}
	defer pool.Close()
	rdb, err := openRedis(ctx, o, redisConnsFor(callers))
	if err != nil {
		return Case{}, err
	}
	defer rdb.Close()

	db := &countingDB{pool: pool}
	lib, err := pgrlLimiter(db, o, false)
	if err != nil {
		return Case{}, err
	}
	var leases leaseSet
	defer func() { _ = leases.close(context.WithoutCancel(ctx)) }()
	pgCheck := pgrlCheck(lib, keys)
	if o.leaseSize > 0 {
		ll, err := leases.wrap(lib, o, db)
		if err != nil {
			return Case{}, err
		}
		pgCheck = leasedCheck(ll, keys)
	}
	paths := []*path{
		newPath(pathPgrl, pgCheck, db),
		newPath(pathRedis, redisCheck(redis_rate.NewLimiter(rdb), keys), nil),
	}
	if o.compareCoalescing {
		udb := &countingDB{pool: pool}
		ulib, err := pgrlLimiter(udb, o, true)
		if err != nil {
			return Case{}, err
		}
		paths = append(paths, newPath(pathUncoalesced, pgrlCheck(ulib, keys), udb))
	}

	for _, v := range o.variants {
		vo := o
		if v.maxInFlight > 0 {
			vo.maxInFlight = v.maxInFlight
		}
		if v.maxBatch > 0 {
			vo.maxBatch = v.maxBatch
		}
		vpool := pool
		if v.conns > 0 {
			vpool, err = openPool(ctx, o.databaseURL, o.schema, v.conns)
			if err != nil {
				return Case{}, err
			}
			defer vpool.Close()
		}
		vdb := &countingDB{pool: vpool}
		vlib, err := pgrlLimiter(vdb, vo, v.off)
		if err != nil {
			return Case{}, err
		}
		paths = append(paths, newPath(v.name, pgrlCheck(vlib, keys), vdb))
	}

	// The pools are all open: their backends are all there is to measure.
	backends, err := backendPIDs(ctx, pool)
	if err != nil {
		return Case{}, err
	}
	run := make([]*loadtest.Path, len(paths))
	for i, p := range paths {
		if p.db != nil {
			p.serverCPU = func(context.Context) time.Duration { return procCPU(backends) }
		} else {
			p.serverCPU = func(ctx context.Context) time.Duration { return redisCPU(ctx, rdb) }
		}
		run[i] = &p.Path
	}
	// The paths take turns going first, so that none always runs right
	// after another.
	plan := loadtest.Plan{Callers: callers, Keys: nkeys, Warmup: o.warmup, Duration: o.duration, Slice: sliceTarget}
	if err := loadtest.Run(ctx, plan, run...); err != nil {
		return Case{}, err
	}
	leaseStats, err := leases.finish(ctx)
	if err != nil {
		return Case{}, err
	}
	pg, rd := paths[0], paths[1]
	c := Case{
		Lease:               leaseStats,
		Callers:             callers,
		Keys:                nkeys,
		PgConns:             pgConnsFor(o, callers),
		RedisConns:          redisConnsFor(callers),
		PgrlOpsPerSec:       loadtest.Round(pg.OpsPerSec(), 1),
		RedisRateOpsPerSec:  loadtest.Round(rd.OpsPerSec(), 1),
		Ratio:               loadtest.Ratio(pg.OpsPerSec(), rd.OpsPerSec()),
		PgrlP50Us:           loadtest.Round(pg.PercentileUs(0.50), 1),
		PgrlP99Us:           loadtest.Round(pg.PercentileUs(0.99), 1),
		RedisRateP50Us:      loadtest.Round(rd.PercentileUs(0.50), 1),
		RedisRateP99Us:      loadtest.Round(rd.PercentileUs(0.99), 1),
		PgrlChecks:          pg.Checks(),
		RedisRateChecks:     rd.Checks(),
		PgrlStatements:      pg.single + pg.many,
		PgrlBatchStatements: pg.many,
		PgrlAvgBatch:        batchAvg(pg),
		PgrlClientCPUUsOp:   cpuPerOp(pg),
		RedisClientCPUUsOp:  cpuPerOp(rd),
		PgrlServerCPUUsOp:   serverPerOp(pg),
		RedisServerCPUUsOp:  serverPerOp(rd),
		PgrlMachineBusy:     loadtest.Round(pg.busy.busyShare(), 3),
		RedisMachineBusy:    loadtest.Round(rd.busy.busyShare(), 3),
	}
	for _, p := range paths[2:] {
		if p.Name == pathUncoalesced {
			continue
		}
		c.Variants = append(c.Variants, Variant{
			Name:           p.Name,
			OpsPerSec:      loadtest.Round(p.OpsPerSec(), 1),
			RatioVsRedis:   loadtest.Ratio(p.OpsPerSec(), rd.OpsPerSec()),
			P50Us:          loadtest.Round(p.PercentileUs(0.50), 1),
			P99Us:          loadtest.Round(p.PercentileUs(0.99), 1),
			AvgBatch:       batchAvg(p),
			ClientCPUUsOp:  cpuPerOp(p),
			ServerCPUUsOp:  serverPerOp(p),
			BatchStatement: p.many,
		})
	}
	if o.compareCoalescing {
		u := paths[2]
		c.Uncoalesced = &Uncoalesced{
			OpsPerSec:     loadtest.Round(u.OpsPerSec(), 1),
			P50Us:         loadtest.Round(u.PercentileUs(0.50), 1),
			P99Us:         loadtest.Round(u.PercentileUs(0.99), 1),
			Checks:        u.Checks(),
			ClientCPUUsOp: cpuPerOp(u),
			ServerCPUUsOp: serverPerOp(u),
			MachineBusy:   loadtest.Round(u.busy.busyShare(), 3),
			GainOps:       loadtest.Ratio(pg.OpsPerSec(), u.OpsPerSec()),
			P50Ratio:      loadtest.Ratio(pg.PercentileUs(0.50), u.PercentileUs(0.50)),
		}
	}
	return c, nil
}

// batchAvg is the average number of checks per statement that pgrl sent.
func batchAvg(p *path) float64 {
	if st := p.single + p.many; st > 0 {
		return loadtest.Round(float64(p.Checks())/float64(st), 2)
	}
	return 0
}

func cpuPerOp(p *path) float64 {
	if p.Checks() == 0 {
		return 0
	}
	return loadtest.Round(float64(p.cpu.Microseconds())/float64(p.Checks()), 2)
}

func serverPerOp(p *path) float64 {
	if p.Checks() == 0 {
		return 0
	}
	return loadtest.Round(float64(p.server.Microseconds())/float64(p.Checks()), 2)
}

// backendPIDs returns the process ids of the server backends of the case's
// pools: every connection is established (openPool), and the benchmark's
// pools are the only ones named vsredis. Idle backends use no CPU, so the
// CPU of all of them during a slice is that of the path that ran.
func backendPIDs(ctx context.Context, pool *pgxpool.Pool) ([]int, error) {
	rows, err := pool.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = 'vsredis'")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// clockTick is the unit of /proc/PID/stat's CPU times (USER_HZ).
const clockTick = 10 * time.Millisecond

// procCPU sums the user and system CPU time of the processes, from
// /proc/PID/stat; a process that cannot be read counts zero. The server
// must run on this machine for it to mean anything.
func procCPU(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			continue
		}
		// Fields after the command name, which is in parentheses and may
		// hold spaces: state is field 3, utime 14, stime 15.
		_, rest, ok := strings.Cut(string(b), ") ")
		f := strings.Fields(rest)
		if !ok || len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		total += time.Duration(ut+st) * clockTick
	}
	return total
}

// redisCPU returns redis-server's CPU time (user + system) from INFO cpu.
func redisCPU(ctx context.Context, rdb *redis.Client) time.Duration {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0
	}
	var total float64
	for _, f := range []string{"used_cpu_user", "used_cpu_sys"} {
		v, _ := strconv.ParseFloat(infoField(info, f), 64)
		total += v
	}
	return time.Duration(total * float64(time.Second))
}

// populate touches every key once on both sides, so that the measured
// checks update existing state.
func populate(ctx context.Context, o options, keys []string) error {
	pool, err := openPool(ctx, o.databaseURL, o.schema, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb, err := openRedis(ctx, o, populateCallers)
	if err != nil {
		return err
	}
	defer rdb.Close()
	lib, err := pgrlLimiter(pool, o, false)
	if err != nil {
		return err
	}
	checks := []loadtest.Check{pgrlCheck(lib, keys), redisCheck(redis_rate.NewLimiter(rdb), keys)}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, populateCallers)
	for w := range populateCallers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				k := int(next.Add(1) - 1)
				if k >= len(keys) {
					return
				}
				for _, check := range checks {
					if err := check(ctx, k); err != nil {
						errs[w] = err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// benchmark prepares both stores and runs every case.
func benchmark(ctx context.Context, o options, log io.Writer) (Report, error) {
	m, err := migration.New(o.databaseURL, migration.Config{Schema: o.schema})
	if err != nil {
		return Report{}, err
	}
	res, err := m.Up(ctx)
	_ = m.Close()
	if err != nil {
		return Report{}, fmt.Errorf("migrate schema %s: %w", o.schema, err)
	}
	if res.Changed() {
		fmt.Fprintf(log, "vsredis: migrated schema %s to version %d\n", o.schema, res.To)
	}

	rep := Report{
		Machine: Machine{
			GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, NumCPU: runtime.NumCPU(),
			CPUModel: cpuModel(), GoVersion: runtime.Version(),
		},
		Schema:           o.schema,
		Algorithm:        string(algorithmOf(o)),
		Limit:            fmt.Sprintf("%d/s, burst %d", benchRate, benchBurst),
		LeaseSize:        o.leaseSize,
		LeaseShare:       o.leaseShare,
		LeaseIdle:        o.leaseIdle.String(),
		DurationSeconds:  o.duration.Seconds(),
		WarmupSeconds:    o.warmup.Seconds(),
		MaxBatch:         o.maxBatch,
		MaxInFlight:      o.maxInFlight,
		PgConnsFlag:      o.pgConns,
		CompareCoalesced: o.compareCoalescing,
		Variants:         variantNames(o.variants),
		Targets:          defaultTargets,
	}
	if algorithmOf(o) != ratelimit.TokenBucket {
		rep.Limit = fmt.Sprintf("%d per 1s window", benchBurst)
	}
	if o.leaseSize > 0 {
		if len(o.keys) > 0 {
			rep.Leased = append(rep.Leased, benchName)
		}
		if o.mix != "" {
			leased, unleased := leasedMixLimits()
			rep.Leased = append(rep.Leased, leased...)
			rep.Unleased = append(rep.Unleased, unleased...)
		}
		if o.compareCoalescing || len(o.variants) > 0 {
			rep.Unleased = append(rep.Unleased, "the --compare-coalescing and --variant paths")
		}
	}
	pool, err := openPool(ctx, o.databaseURL, o.schema, 1)
	if err != nil {
		return rep, err
	}
	err = pool.QueryRow(ctx, `SELECT current_setting('server_version'),
	        current_setting('wal_writer_flush_after'), current_setting('synchronous_commit')`).
		Scan(&rep.Machine.PostgresVersion, &rep.Machine.WalWriterFlushAfter, &rep.Machine.SynchronousCommit)
	pool.Close()
	if err != nil {
		return rep, err
	}
	rdb, err := openRedis(ctx, o, 1)
	if err != nil {
		return rep, err
	}
	info, err := rdb.Info(ctx, "server").Result()
	_ = rdb.Close()
	if err != nil {
		return rep, fmt.Errorf("redis INFO: %w", err)
	}
	rep.Machine.RedisVersion = infoField(info, "redis_version")

	var keys []string
	if len(o.keys) > 0 {
		keys = make([]string, slices.Max(o.keys))
		for i := range keys {
			keys[i] = keyName(i)
		}
		fmt.Fprintf(log, "vsredis: touching %d keys in PostgreSQL and Redis\n", len(keys))
		if err := populate(ctx, o, keys); err != nil {
			return rep, fmt.Errorf("populate: %w", err)
		}
	}
	var mix *appMix
	if o.mix != "" {
		mix = newAppMix(mixSeed, o.mixRequests)
		rep.Mix = mixDescription(o.mixRequests)
		fmt.Fprintf(log, "vsredis: application mix: touching %d limits and keys in PostgreSQL and Redis\n", len(mix.touch))
		if err := populateMix(ctx, o, mix); err != nil {
			return rep, fmt.Errorf("populate the application mix: %w", err)
		}
	}
	for _, callers := range o.callers {
		for _, nkeys := range o.keys {
			fmt.Fprintf(log, "vsredis: %d callers, %d keys, %v per path\n", callers, nkeys, o.duration)
			c, err := runCase(ctx, o, keys, callers, nkeys)
			if err != nil {
				return rep, fmt.Errorf("%d callers, %d keys: %w", callers, nkeys, err)
			}
			rep.Cases = append(rep.Cases, c)
		}
		if mix != nil {
			fmt.Fprintf(log, "vsredis: %d callers, application mix, %v per path\n", callers, o.duration)
			c, err := runMixCase(ctx, o, mix, callers)
			if err != nil {
				return rep, fmt.Errorf("%d callers, application mix: %w", callers, err)
			}
			rep.MixCases = append(rep.MixCases, c)
		}
	}
	rep.TargetsMet, rep.TargetMisses = rep.Targets.check(rep.Cases)
	return rep, nil
}

// infoField returns one field of a Redis INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// cpuModel returns the processor's model name from /proc/cpuinfo, or "".
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if k, v, ok := strings.Cut(s.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// processCPU returns the user and system CPU time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuSample is the machine's CPU time from /proc/stat, in clock ticks.
type cpuSample struct{ busy, total int64 }

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return cpuSample{}
	}
	var s cpuSample
	for i, f := range fields[1:] {
		v, _ := strconv.ParseInt(f, 10, 64)
		if i >= 8 { // guest time is already counted in user time
			break
		}
		s.total += v
		if i != 3 && i != 4 { // idle, iowait
			s.busy += v
		}
	}
	return s
}

func (s cpuSample) sub(o cpuSample) cpuSample { return cpuSample{s.busy - o.busy, s.total - o.total} }
func (s cpuSample) add(o cpuSample) cpuSample { return cpuSample{s.busy + o.busy, s.total + o.total} }

// busyShare is the share of the machine's CPU time that was busy.
func (s cpuSample) busyShare() float64 {
	if s.total <= 0 {
		return 0
	}
	return float64(s.busy) / float64(s.total)
}

func variantNames(vs []variant) []string {
	var out []string
	for _, v := range vs {
		out = append(out, v.name)
	}
	return out
}
