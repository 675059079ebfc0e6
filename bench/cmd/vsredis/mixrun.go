package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"

	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// mixLimiters are pgrl's side of the application mix: one limiter per limit
// of the policy table, all from one Database on one pool (so that their
// checks, AllowAll's included, share one coalescer and one breaker) but the
// beacon's, in memory.
type mixLimiters struct {
	db     [numMixLimits]*ratelimit.Limiter // nil for the memory limit
	beacon *ratelimit.MemoryLimiter
	// leased holds, with --lease-size, the lease limiters on db's that a
	// single check uses (nil for the others).
	leased [numMixLimits]*leasedLimit
}

// mixConfig is pgrl's version of limit l: a token bucket, as redis_rate's
// GCRA, with the limit's rate, period and burst; with a fixed or sliding
// window (--algorithm), the limit's burst per window of its period, so that
// every check is admitted as well.
func mixConfig(l mixLimit, a ratelimit.Algorithm) ratelimit.Config {
	if a != ratelimit.TokenBucket && a != "" {
		return ratelimit.Config{
			Name:      l.name,
			Algorithm: a,
			Limit:     l.burst,
			Window:    l.period,
			OnFailure: ratelimit.FailError,
		}
	}
	return ratelimit.Config{
		Name:      l.name,
		Algorithm: ratelimit.TokenBucket,
		Limit:     l.rate,
		Window:    l.period,
		Burst:     l.burst,
		OnFailure: ratelimit.FailError, // an error must stop the run, not be answered from memory
	}
}

// mixOptions are the options of the Database the mix's limits are kept in:
// the coalescer's settings of the run.
func mixOptions(o options) ratelimit.DatabaseOptions {
	return ratelimit.DatabaseOptions{MaxBatch: o.maxBatch, MaxInFlight: o.maxInFlight}
}

func newMixLimiters(db ratelimit.DB, o options) (*mixLimiters, error) {
	m := &mixLimiters{}
	limits, err := ratelimit.NewDatabase(db, mixOptions(o))
	if err != nil {
		return nil, err
	}
	for i, l := range appLimits {
		var err error
		if l.memory {
			cfg := mixConfig(l, algorithmOf(o))
			cfg.OnFailure = ratelimit.FailToMemory // the default: a memory limiter has no database to fail
			m.beacon, err = ratelimit.NewMemory(cfg, ratelimit.MemoryOptions{MaxKeys: 100_000})
		} else {
			m.db[i], err = limits.Limiter(mixConfig(l, algorithmOf(o)))
		}
		if err != nil {
			return nil, fmt.Errorf("limit %s: %w", l.name, err)
		}
	}
	return m, nil
}

// lease wraps every database limiter of the mix with lease.New; a login's
// three limits are then checked together with lease.AllowAll.
func (m *mixLimiters) lease(o options, db ratelimit.DB, set *leaseSet) error {
	for i, l := range m.db {
		if l == nil {
			continue
		}
		ll, err := set.wrap(l, o, db)
		if err != nil {
			return err
		}
		m.leased[i] = ll
	}
	return nil
}

// allow makes one check on its limiter and verifies it was admitted by the
// store the limit lives in.
func (m *mixLimiters) allow(ctx context.Context, c mixCheck) (pg bool, err error) {
	var d ratelimit.Decision
	want := ratelimit.StorePostgres
	if appLimits[c.limit].memory {
		want = ratelimit.StoreMemory
		d, err = m.beacon.Allow(ctx, c.key)
	} else if ll := m.leased[c.limit]; ll != nil {
		d, err = ll.Allow(ctx, c.key)
		if err != nil {
			return false, err
		}
		return true, ll.admit(c.key, d)
	} else {
		d, err = m.db[c.limit].Allow(ctx, c.key)
	}
	if err != nil {
		return false, err
	}
	if !d.Allowed || d.Store != want {
		return false, fmt.Errorf("check of %s %q: allowed=%v store=%v: the mix measures admitted checks decided by %v", appLimits[c.limit].name, c.key, d.Allowed, d.Store, want)
	}
	return want == ratelimit.StorePostgres, nil
}

// allowAll decides a login's checks, all or nothing: with ratelimit.AllowAll
// in one statement, or, leased, with lease.AllowAll from the limits'
// slices (each admitted check verified and counted as a leased one).
func (m *mixLimiters) allowAll(ctx context.Context, cs []mixCheck) (ratelimit.MultiDecision, error) {
	if m.leased[cs[0].limit] == nil {
		checks := make([]ratelimit.Check, len(cs))
		for i, c := range cs {
			checks[i] = ratelimit.Check{Limiter: m.db[c.limit], Key: c.key}
		}
		return ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
	}
	checks := make([]lease.Check, len(cs))
	for i, c := range cs {
		checks[i] = lease.Check{Limiter: m.leased[c.limit].Limiter, Key: c.key}
	}
	md, err := lease.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
	if err != nil || !md.Allowed {
		return md, err
	}
	for i, c := range cs {
		if err := m.leased[c.limit].admit(c.key, md.Decisions[i]); err != nil {
			return md, err
		}
	}
	return md, nil
}

// pgrlMixCheck makes request k of the mix with pgrl: a login's three limits
// in one AllowAll decision, all or nothing, as the example application
// does; any other endpoint's one check with Allow.
func pgrlMixCheck(mix *appMix, lims *mixLimiters, t *checkTally) loadtest.Check {
	return func(ctx context.Context, k int) error {
		req := &mix.requests[k]
		if len(req.checks) == 1 {
			pg, err := lims.allow(ctx, req.checks[0])
			if err != nil {
				return err
			}
			t.checks.Add(1)
			if pg {
				t.pg.Add(1)
			}
			return nil
		}
		md, err := lims.allowAll(ctx, req.checks)
		if err != nil {
			return err
		}
		for i, d := range md.Decisions {
			if !d.Allowed || (d.Store != ratelimit.StorePostgres && d.Store != ratelimit.StoreLease) {
				return fmt.Errorf("%s: check of %s %q: allowed=%v store=%v: the mix measures admitted checks decided by PostgreSQL or a lease",
					appEndpoints[req.endpoint].name, appLimits[req.checks[i].limit].name, req.checks[i].key, d.Allowed, d.Store)
			}
		}
		if !md.Allowed {
			return fmt.Errorf("%s denied (by check %d): the mix measures admitted checks", appEndpoints[req.endpoint].name, md.DeniedBy)
		}
		n := int64(len(req.checks))
		t.checks.Add(n)
		t.pg.Add(n)
		return nil
	}
}

// redisMixLimits are the mix's limits in redis_rate's terms.
var redisMixLimits = func() (out [numMixLimits]redis_rate.Limit) {
	for i, l := range appLimits {
		out[i] = redis_rate.Limit{Rate: int(l.rate), Period: l.period, Burst: int(l.burst)}
	}
	return out
}()

// redisMixCheck makes request k of the mix with redis_rate: one Allow per
// limit, one after the other, as a redis_rate user checks several limits.
func redisMixCheck(mix *appMix, l *redis_rate.Limiter, t *checkTally) loadtest.Check {
	return func(ctx context.Context, k int) error {
		req := &mix.requests[k]
		for _, c := range req.checks {
			res, err := l.Allow(ctx, c.redisKey, redisMixLimits[c.limit])
			if err != nil {
				return err
			}
			if res.Allowed != 1 {
				return fmt.Errorf("check of %q denied: the mix measures admitted checks", c.redisKey)
			}
		}
		t.checks.Add(int64(len(req.checks)))
		return nil
	}
}

// populateMix touches every limit and key of the mix once on both sides,
// so that the measured checks update existing state.
func populateMix(ctx context.Context, o options, mix *appMix) error {
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
	lims, err := newMixLimiters(pool, o)
	if err != nil {
		return err
	}
	rl := redis_rate.NewLimiter(rdb)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, populateCallers)
	for w := range populateCallers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(mix.touch) {
					return
				}
				c := mix.touch[i]
				if _, err := lims.allow(ctx, c); err != nil {
					errs[w] = err
					return
				}
				if _, err := rl.Allow(ctx, c.redisKey, redisMixLimits[c.limit]); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// runMixCase measures the application mix on both sides at one number of
// callers.
func runMixCase(ctx context.Context, o options, mix *appMix, callers int) (MixCase, error) {
	pool, err := openPool(ctx, o.databaseURL, o.schema, pgConnsFor(o, callers))
	if err != nil {
		return MixCase{}, err
	}
	defer pool.Close()
	rdb, err := openRedis(ctx, o, redisConnsFor(callers))
	if err != nil {
		return MixCase{}, err
	}
	defer rdb.Close()

	db := &countingDB{pool: pool}
	lims, err := newMixLimiters(db, o)
	if err != nil {
		return MixCase{}, err
	}
	var leases leaseSet
	defer func() { _ = leases.close(context.WithoutCancel(ctx)) }()
	if o.leaseSize > 0 {
		if err := lims.lease(o, db, &leases); err != nil {
			return MixCase{}, err
		}
	}
	pgTally, rdTally := &checkTally{}, &checkTally{}
	pg := newPath(pathPgrl, pgrlMixCheck(mix, lims, pgTally), db)
	pg.tally = pgTally
	rd := newPath(pathRedis, redisMixCheck(mix, redis_rate.NewLimiter(rdb), rdTally), nil)
	rd.tally = rdTally

	backends, err := backendPIDs(ctx, pool)
	if err != nil {
		return MixCase{}, err
	}
	pg.serverCPU = func(context.Context) time.Duration { return procCPU(backends) }
	rd.serverCPU = func(ctx context.Context) time.Duration { return redisCPU(ctx, rdb) }
	// Key number k is request k of the mix, drawn uniformly by each caller.
	plan := loadtest.Plan{Callers: callers, Keys: len(mix.requests), Warmup: o.warmup, Duration: o.duration, Slice: sliceTarget}
	if err := loadtest.Run(ctx, plan, &pg.Path, &rd.Path); err != nil {
		return MixCase{}, err
	}
	leaseStats, err := leases.finish(ctx)
	if err != nil {
		return MixCase{}, err
	}
	c := mixCaseOf(callers, pgConnsFor(o, callers), redisConnsFor(callers), pg, rd)
	c.Lease = leaseStats
	return c, nil
}

// mixCaseOf is the report row of a mix case from its measured paths.
func mixCaseOf(callers, pgConns, redisConns int, pg, rd *path) MixCase {
	perSec := func(n int64, p *path) float64 {
		if p.Elapsed <= 0 {
			return 0
		}
		return loadtest.Round(float64(n)/p.Elapsed.Seconds(), 1)
	}
	per := func(n, d int64) float64 {
		if d <= 0 {
			return 0
		}
		return loadtest.Round(float64(n)/float64(d), 2)
	}
	statements := pg.single + pg.many + pg.batched
	roundTrips := pg.single + pg.many + pg.batches
	return MixCase{
		Mix:                        mixApp,
		Callers:                    callers,
		PgConns:                    pgConns,
		RedisConns:                 redisConns,
		PgrlRequestsPerSec:         loadtest.Round(pg.OpsPerSec(), 1),
		RedisRateRequestsPerSec:    loadtest.Round(rd.OpsPerSec(), 1),
		Ratio:                      loadtest.Ratio(pg.OpsPerSec(), rd.OpsPerSec()),
		PgrlChecksPerSec:           perSec(pg.checks, pg),
		RedisRateChecksPerSec:      perSec(rd.checks, rd),
		PgrlP50Us:                  loadtest.Round(pg.PercentileUs(0.50), 1),
		PgrlP99Us:                  loadtest.Round(pg.PercentileUs(0.99), 1),
		RedisRateP50Us:             loadtest.Round(rd.PercentileUs(0.50), 1),
		RedisRateP99Us:             loadtest.Round(rd.PercentileUs(0.99), 1),
		PgrlRequests:               pg.Checks(),
		RedisRateRequests:          rd.Checks(),
		PgrlChecks:                 pg.checks,
		RedisRateChecks:            rd.checks,
		PgrlPostgresChecks:         pg.pgChecks,
		PgrlStatements:             statements,
		PgrlRoundTrips:             roundTrips,
		PgrlChecksPerStatement:     per(pg.pgChecks, statements),
		PgrlStatementsPerRoundTrip: per(statements, roundTrips),
		PgrlClientCPUUsReq:         cpuPerOp(pg),
		RedisClientCPUUsReq:        cpuPerOp(rd),
		PgrlServerCPUUsReq:         serverPerOp(pg),
		RedisServerCPUUsReq:        serverPerOp(rd),
		PgrlMachineBusy:            loadtest.Round(pg.busy.busyShare(), 3),
		RedisMachineBusy:           loadtest.Round(rd.busy.busyShare(), 3),
	}
}
