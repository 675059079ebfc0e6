package tests

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// faultSlack is how far past its Timeout a check may answer: the issue's
// budget of 10 ms, or 50 ms when the race detector slows every instruction
// down several times.
var faultSlack = func() time.Duration {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "-race" && s.Value == "true" {
				return 50 * time.Millisecond
			}
		}
	}
	return 10 * time.Millisecond
}()

// faultPool opens a pool on url with the given application_name and
// server-side statement_timeout ("" for none), closed when the test ends.
func faultPool(t testing.TB, url, appName, statementTimeout string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	if statementTimeout != "" {
		cfg.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = statementTimeout
	}
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// machineBaseline is how fast this machine answers checks right now, measured
// inside the test under the test's own kind of load. Fault tests derive their
// check deadlines and latency bounds from it instead of from fixed
// milliseconds: on a busy machine a healthy check may take longer than a
// fixed 100 ms, and a test that then sees a timeout would be measuring the
// machine, not the library.
type machineBaseline struct {
	// warm is the slowest check on an open connection under 8 goroutines'
	// load.
	warm time.Duration
	// cold is the slowest of 8 simultaneous checks that each first open
	// their connection, as after a restart, a cut or killed backends.
	cold time.Duration
	// wake is the latest a goroutine's 1 ms timer fired under the same load:
	// how long the scheduler may take to run a caller whose deadline passed.
	wake time.Duration
}

// measureBaseline measures a machineBaseline against the database at url,
// and waits for that database to answer (for at most a minute) first.
func measureBaseline(t *testing.T, url string) machineBaseline {
	t.Helper()
	ctx := context.Background()
	var b machineBaseline
	for round := range 3 {
		// A pool of its own each round, so that every check opens its
		// connection.
		pool := baselinePool(t, url)
		// It measures how long checks take here, so it waits as long as
		// they take: the default Timeout would cut a cold check on a
		// loaded machine short and measure nothing.
		l, err := testkit.New(pool, ratelimit.Config{Name: "baseline", Limit: 1_000_000, Window: time.Hour, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{DisableCoalescing: true, Timeout: testkit.DecisionTimeout})
		require.NoError(t, err)
		if round == 0 {
			// The server may still be starting up after a restart: wait
			// for it before timing anything.
			require.True(t, settleWithin(time.Minute, func() bool {
				_, err := l.Allow(ctx, "ready")
				return err == nil
			}), "the server answers within a minute")
			pool.Reset()
		}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				start := time.Now()
				_, err := l.Allow(ctx, fmt.Sprintf("cold-%d-%d", round, i))
				lat := time.Since(start)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					t.Errorf("baseline check: %v", err)
				}
				b.cold = max(b.cold, lat)
			}()
		}
		wg.Wait()
		pool.Close()
	}

	pool := baselinePool(t, url)
	defer pool.Close()
	// Measured, not bounded: its checks wait as long as they take here.
	l, err := testkit.New(pool, ratelimit.Config{Name: "baseline", Limit: 1_000_000, Window: time.Hour, OnFailure: ratelimit.FailError}, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})
	require.NoError(t, err)
	for _, d := range []time.Duration{200 * time.Millisecond, 500 * time.Millisecond} {
		// The first round opens the pool's connections; the second is the
		// measure.
		st := &loadStats{byStore: map[ratelimit.Store]int{}}
		stop := make(chan struct{})
		wakeDone := make(chan time.Duration)
		go func() {
			var late time.Duration
			for {
				select {
				case <-stop:
					wakeDone <- late
					return
				default:
				}
				start := time.Now()
				time.Sleep(time.Millisecond)
				late = max(late, time.Since(start)-time.Millisecond)
			}
		}()
		time.AfterFunc(d, func() { close(stop) })
		runLoad(l, 8, stop, st, nil)
		b.wake = <-wakeDone
		require.Empty(t, st.errs, "the healthy server answers the baseline checks")
		b.warm = st.maxLatency
	}
	t.Logf("baseline: warm check at most %v, cold check at most %v, timer late by at most %v; check deadline %v, latency slack %v",
		b.warm.Round(time.Microsecond), b.cold.Round(time.Microsecond), b.wake.Round(time.Microsecond), b.timeout(), b.slack())
	return b
}

// baselinePool is faultPool for measuring: its connections may take up to
// 30 s to open, since how long they take is what is measured.
func baselinePool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["application_name"] = "pgrl-fault-baseline"
	cfg.ConnConfig.ConnectTimeout = 30 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// slack is how far past its deadline a check may answer: faultSlack (the
// issue's 10 ms, 50 ms under the race detector), three times the timer
// lateness measured, or the slowest healthy check, whichever is larger.
// Answering by the policy once the deadline has passed is less work than a
// round trip, so on this machine it should take no longer than one did.
func (b machineBaseline) slack() time.Duration {
	return max(faultSlack, 3*b.wake, b.warm)
}

// late is how far past timeout a check may answer: slack, and one tick of
// the Database's deadline goroutine, which ends a check up to a sixteenth
// of its Timeout after its deadline (ratelimit.DatabaseOptions.Timeout).
func (b machineBaseline) late(timeout time.Duration) time.Duration {
	return b.slack() + timeout/16
}

// timeout is the check deadline a fault test gives its limiter: 100 ms, or
// more when this machine is slower than that allows for a healthy check
// (5 × the slowest warm check, 3 × the slowest cold one). It is never under
// 4 × slack, so that a check answering a whole deadline late is still caught.
func (b machineBaseline) timeout() time.Duration {
	return max(100*time.Millisecond, 5*b.warm, 3*b.cold, 4*b.slack()).Round(time.Millisecond)
}

// recoveryBound is how soon after a fault ends PostgreSQL must answer
// again: 2 s, or, on a slower machine, two breaker cool-downs, deadlines and
// cold checks.
func (b machineBaseline) recoveryBound(cooldown time.Duration) time.Duration {
	return max(2*time.Second, 2*(cooldown+b.timeout()+b.cold))
}

// pgDuration formats d for a PostgreSQL setting such as statement_timeout.
func pgDuration(d time.Duration) string {
	return fmt.Sprintf("%dms", d.Milliseconds())
}

// warmUntilHealthy runs 8 goroutines' load on l in rounds of 200 ms until a
// whole round is answered by PostgreSQL with no error (and the breaker is
// closed), for at most 30 s, and returns that round's stats. A test's
// preconditions wait for the server this way rather than assuming it
// answers at once (after a restart it may not yet).
func warmUntilHealthy(t *testing.T, l *ratelimit.Limiter) *loadStats {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := &loadStats{byStore: map[ratelimit.Store]int{}}
		stop := make(chan struct{})
		time.AfterFunc(200*time.Millisecond, func() { close(stop) })
		runLoad(l, 8, stop, st, nil)
		healthy := len(st.errs) == 0 && st.checks > 0 && st.byStore[ratelimit.StorePostgres] == st.checks && !l.BreakerOpen()
		if healthy {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server did not answer a whole round of warm-up checks within 30 s: stores %v, errors %v", st.byStore, st.errs)
		}
	}
}

// policyCase is one failure policy and what its answer looks like while
// the database is down.
type policyCase struct {
	name   string
	policy ratelimit.FailurePolicy
	// check verifies a decision made without PostgreSQL.
	check func(d ratelimit.Decision) error
}

var policyCases = []policyCase{
	{"memory", ratelimit.FailToMemory, func(d ratelimit.Decision) error {
		if d.Store != ratelimit.StoreMemory || d.Reason == "" {
			return fmt.Errorf("want a memory decision with a reason, got store %q reason %q", d.Store, d.Reason)
		}
		return nil
	}},
	{"open", ratelimit.FailOpen, func(d ratelimit.Decision) error {
		if d.Store != ratelimit.StorePolicy || !d.Allowed || d.Reason == "" {
			return fmt.Errorf("want an allowing policy decision, got store %q allowed %v", d.Store, d.Allowed)
		}
		return nil
	}},
	{"closed", ratelimit.FailClosed, func(d ratelimit.Decision) error {
		if d.Store != ratelimit.StorePolicy || d.Allowed || d.RetryAfter <= 0 {
			return fmt.Errorf("want a denying policy decision with a retry time, got store %q allowed %v retry %v", d.Store, d.Allowed, d.RetryAfter)
		}
		return nil
	}},
}

// loadStats gathers what a load test's callers saw.
type loadStats struct {
	mu         sync.Mutex
	checks     int
	byStore    map[ratelimit.Store]int
	maxLatency time.Duration
	errs       []error
	wrong      []error
	// firstPostgresAfter is the first instant a check answered by
	// PostgreSQL returned after the instant in watchFrom (zero if none).
	watchFrom          time.Time
	firstPostgresAfter time.Time
}

func (s *loadStats) add(d ratelimit.Decision, err error, lat time.Duration, verify func(ratelimit.Decision) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks++
	s.maxLatency = max(s.maxLatency, lat)
	if err != nil {
		if len(s.errs) < 10 {
			s.errs = append(s.errs, err)
		}
		return
	}
	s.byStore[d.Store]++
	if d.Store == ratelimit.StorePostgres {
		if !s.watchFrom.IsZero() && s.firstPostgresAfter.IsZero() {
			s.firstPostgresAfter = time.Now()
		}
		return
	}
	if d.Store != ratelimit.StoreDenyCache && verify != nil {
		if e := verify(d); e != nil && len(s.wrong) < 10 {
			s.wrong = append(s.wrong, e)
		}
	}
}

// runLoad runs workers goroutines checking random keys on l until stop
// closes, and returns when they have all returned.
func runLoad(l *ratelimit.Limiter, workers int, stop <-chan struct{}, st *loadStats, verify func(ratelimit.Decision) error) {
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("k%d", rng.IntN(200))
				start := time.Now()
				d, err := l.Allow(context.Background(), key)
				st.add(d, err, time.Since(start), verify)
				// A caller does some work between checks; without it, 8
				// goroutines spinning on memory answers starve a 2-core
				// machine and every latency measures the scheduler.
				time.Sleep(time.Duration(200+rng.IntN(600)) * time.Microsecond)
			}
		}()
	}
	wg.Wait()
}

// settle waits up to 5 s for cond, polling.
func settle(cond func() bool) bool {
	return settleWithin(5*time.Second, cond)
}

// settleWithin waits up to d for cond, polling.
func settleWithin(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return cond()
}

// TestFaultServerStoppedDuringLoad stops the throwaway server (pg_ctl stop
// -m fast) in the middle of 8 goroutines' load and starts it again, once per
// failure policy. Every check answers within its deadline (plus the
// scheduler's slack) with its policy's answer and no error; the outage is
// logged once, and so is the recovery; after the restart PostgreSQL answers
// again within 2 s (more on a machine measured slower); goroutines return to
// their baseline and no connection is held or left open outside the pool.
// The deadline and bounds come from a baseline measured first, and the load
// starts only once the server answers every check of a warm-up round.
func TestFaultServerStoppedDuringLoad(t *testing.T) {
	c := newCluster(t)
	for _, pc := range policyCases {
		t.Run(pc.name, func(t *testing.T) {
			// The previous subtest restarted the server: wait for it, and
			// measure how fast it answers now.
			b := measureBaseline(t, c.url())
			timeout := b.timeout()
			logs := &testkit.LogBuffer{}
			pool := faultPool(t, c.url(), "pgrl-fault-stop", pgDuration(timeout*8/10))
			l, err := testkit.New(pool, ratelimit.Config{Name: "stop-" + pc.name, Limit: 1_000_000, Window: time.Hour, OnFailure: pc.policy}, ratelimit.DatabaseOptions{Timeout: timeout, Logger: slog.New(slog.NewTextHandler(logs, nil))})
			require.NoError(t, err)

			// Baseline goroutines and connections: after a warm-up with
			// the same load, once the server answers all of it.
			warmUntilHealthy(t, l)
			logs.Reset()
			runtime.GC()
			baseG := runtime.NumGoroutine()
			baseConns := pool.Stat().TotalConns()

			st := &loadStats{byStore: map[ratelimit.Store]int{}}
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() { runLoad(l, 8, stop, st, pc.check); close(done) }()

			time.Sleep(700 * time.Millisecond)
			c.stop("fast")
			down := time.Now()
			time.Sleep(time.Second)
			c.start()
			restarted := time.Now()
			st.mu.Lock()
			st.watchFrom = restarted
			st.mu.Unlock()
			// Run on until PostgreSQL has answered, and a little past it.
			bound := b.recoveryBound(500 * time.Millisecond)
			ok := settleWithin(2*bound, func() bool {
				st.mu.Lock()
				defer st.mu.Unlock()
				return !st.firstPostgresAfter.IsZero() && time.Since(st.firstPostgresAfter) > 300*time.Millisecond
			})
			close(stop)
			<-done
			require.True(t, ok, "PostgreSQL never answered again after the restart")

			recovery := st.firstPostgresAfter.Sub(restarted)
			t.Logf("%s: %d checks, stores %v, max latency %v (timeout %v, overshoot %v, slack %v), down for %v, PostgreSQL answering %v after the restart (bound %v)",
				pc.name, st.checks, st.byStore, st.maxLatency, timeout, max(st.maxLatency-timeout, 0), b.slack(), restarted.Sub(down).Round(time.Millisecond), recovery.Round(time.Millisecond), bound)
			require.Empty(t, st.errs, "no caller sees an error")
			require.Empty(t, st.wrong, "every answer without PostgreSQL is the policy's")
			require.LessOrEqual(t, st.maxLatency, timeout+b.late(timeout), "every check answers within its deadline + slack")
			require.Positive(t, st.byStore[ratelimit.StorePolicy]+st.byStore[ratelimit.StoreMemory], "some checks were answered without PostgreSQL")
			require.LessOrEqual(t, recovery, bound, "PostgreSQL answers again soon after the restart")

			// The outage is logged once, and so is the recovery.
			out := logs.String()
			require.Equal(t, 1, strings.Count(out, "database unavailable"), "one outage log line:\n%s", out)
			require.Equal(t, 1, strings.Count(out, "database answering again"), "one recovery log line:\n%s", out)

			// Goroutines back to their baseline, no connection held, and
			// no connection left open on the server that the pool does not
			// know of. (How many idle connections the pool keeps after a
			// burst is the pool's business, not a leak.)
			var g int
			var conns, acquired int32
			var server int64
			back := settle(func() bool {
				runtime.GC()
				g = runtime.NumGoroutine()
				s := pool.Stat()
				conns, acquired = s.TotalConns(), s.AcquiredConns()
				if err := pool.QueryRow(context.Background(),
					"SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgrl-fault-stop'").Scan(&server); err != nil {
					return false
				}
				return g <= baseG+2 && acquired == 0 && server <= int64(pool.Stat().TotalConns())
			})
			t.Logf("%s: goroutines %d (baseline %d), pool connections %d (baseline %d), on the server %d, acquired %d, opened in all %d",
				pc.name, g, baseG, conns, baseConns, server, acquired, pool.Stat().NewConnsCount())
			require.True(t, back, "goroutines return to their baseline, and no connection is held or left open outside the pool")
		})
	}
}

// TestFaultRowLockHeld holds a counter's row lock in another transaction
// (SELECT … FOR UPDATE, left open). The counter is a token bucket, one row
// per key: a fixed window's check moves to a new, unlocked row when the
// window ends, which once let a "locked" check through at 16:00:00. Checks of that key answer within the
// deadline by their policy; checks of other keys are answered by PostgreSQL
// meanwhile. Run with the server's statement_timeout under the client
// deadline (the connection survives: PostgreSQL cancels the statement) and
// with the client deadline alone (pgx closes the connection). The deadline
// is 100 ms, or more when a baseline measured first says this machine needs
// it, and statement_timeout is half of it.
func TestFaultRowLockHeld(t *testing.T) {
	bs := dbtest.NewSchema(t)
	dbtest.Migrate(t, bs)
	b := measureBaseline(t, dbtest.URLWithSchema(bs))
	timeout := b.timeout()
	for _, variant := range []struct {
		name             string
		statementTimeout string
	}{{"statement_timeout", pgDuration(timeout / 2)}, {"client_deadline_only", ""}} {
		t.Run(variant.name, func(t *testing.T) {
			for _, pc := range policyCases {
				t.Run(pc.name, func(t *testing.T) {
					s := dbtest.NewSchema(t)
					dbtest.Migrate(t, s)
					pool := dbtest.PoolOn(t, s, func(c *pgxpool.Config) {
						if variant.statementTimeout != "" {
							c.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = variant.statementTimeout
						}
					})
					ctx := context.Background()
					name := "lock-" + pc.name
					l, err := testkit.New(pool, ratelimit.Config{Name: name, Algorithm: ratelimit.TokenBucket, Limit: 1000, Window: time.Hour, OnFailure: pc.policy}, ratelimit.DatabaseOptions{Timeout: timeout})
					require.NoError(t, err)
					// Create the hot key's row (without a deadline: on a busy
					// machine the first connection may take a while).
					setup, err := testkit.New(pool, ratelimit.Config{Name: name, Algorithm: ratelimit.TokenBucket, Limit: 1000, Window: time.Hour, OnFailure: ratelimit.FailError})
					require.NoError(t, err)
					_, err = setup.Allow(ctx, "hot")
					require.NoError(t, err)

					// Another session locks the hot key's row and keeps the
					// transaction open.
					locker := dbtest.PoolOn(t, s)
					tx, err := locker.Begin(ctx)
					require.NoError(t, err)
					defer func() { _ = tx.Rollback(ctx) }()
					tag, err := tx.Exec(ctx, "SELECT 1 FROM pgrl_token_bucket WHERE key = $1 FOR UPDATE", multiprocessHashedKey(name, "hot"))
					require.NoError(t, err)
					require.EqualValues(t, 1, tag.RowsAffected(), "the hot key's row is locked")
					before := pool.Stat().NewConnsCount()

					var maxHot, maxOther time.Duration
					otherPG := 0
					for i := range 4 {
						start := time.Now()
						d, err := l.Allow(ctx, "hot")
						lat := time.Since(start)
						maxHot = max(maxHot, lat)
						require.NoError(t, err)
						require.NoError(t, pc.check(d), "hot check %d", i)
						require.LessOrEqual(t, lat, timeout+b.late(timeout), "hot check %d answers within the deadline", i)

						start = time.Now()
						d, err = l.Allow(ctx, fmt.Sprintf("other-%d", i))
						maxOther = max(maxOther, time.Since(start))
						require.NoError(t, err)
						require.True(t, d.Allowed)
						if d.Store == ratelimit.StorePostgres {
							otherPG++
						}
					}
					if variant.statementTimeout != "" {
						require.Equal(t, 4, otherPG, "other keys are answered by PostgreSQL")
					} else {
						// Each timed-out check closed its connection, so an
						// other key's check may have to open one within its
						// deadline; on a busy machine it may not.
						require.Positive(t, otherPG, "other keys are answered by PostgreSQL")
					}
					opened := pool.Stat().NewConnsCount() - before
					t.Logf("%s/%s: locked key answered in at most %v, other keys in at most %v (%d of 4 by PostgreSQL); connections opened during the lock: %d",
						variant.name, pc.name, maxHot, maxOther, otherPG, opened)
					if variant.statementTimeout != "" {
						require.Zero(t, opened, "with statement_timeout the server cancels the statement and the connection survives")
					}
					require.NoError(t, tx.Rollback(ctx))
					// Once the lock is gone PostgreSQL answers the key again
					// (after a connection is reopened, which a busy machine
					// may not do within the first check's deadline).
					var d ratelimit.Decision
					require.True(t, settle(func() bool {
						d, err = l.Allow(ctx, "hot")
						return err == nil && d.Store == ratelimit.StorePostgres
					}), "the key is answered by PostgreSQL once the lock is gone: %+v, %v", d, err)
				})
			}
		})
	}
}

// TestFaultRowLockManyCallers hammers a key whose row lock another
// transaction holds with 8 goroutines while one goroutine checks other keys.
// Timeouts on one locked row are not an outage of the database: with a
// lock_timeout set (below statement_timeout, below Timeout), the lock waits
// that run out do not open the breaker, and checks of other keys are still
// answered by PostgreSQL.
func TestFaultRowLockManyCallers(t *testing.T) {
	s := dbtest.NewSchema(t)
	dbtest.Migrate(t, s)
	// Wide margins over lock_timeout, taken from a baseline measured here,
	// so that on a busy machine the lock waits still end by lock_timeout,
	// not by a deadline.
	margin := 2 * measureBaseline(t, dbtest.URLWithSchema(s)).timeout()
	const lockTimeout = 50 * time.Millisecond
	pool := dbtest.PoolOn(t, s, func(c *pgxpool.Config) {
		c.MaxConns = 12
		c.ConnConfig.RuntimeParams["lock_timeout"] = pgDuration(lockTimeout)
		c.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = pgDuration(lockTimeout + margin)
	})
	ctx := context.Background()
	const name = "lock-many"
	// Coalescing on (the default): checks of other keys must not queue
	// behind the statements waiting on the locked row.
	cfg := ratelimit.Config{Name: name, Algorithm: ratelimit.TokenBucket, Limit: 100000, Window: time.Hour}
	l, err := testkit.New(pool, cfg, ratelimit.DatabaseOptions{Timeout: lockTimeout + 2*margin})
	require.NoError(t, err)
	_, err = l.Allow(ctx, "hot")
	require.NoError(t, err)
	tx, err := dbtest.PoolOn(t, s).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT 1 FROM pgrl_token_bucket WHERE key = $1 FOR UPDATE", multiprocessHashedKey(name, "hot"))
	require.NoError(t, err)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var hotErrs atomic.Int64
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := l.Allow(ctx, "hot"); err != nil {
					hotErrs.Add(1)
				}
			}
		}()
	}
	byStore := map[ratelimit.Store]int{}
	for i := range 100 {
		d, err := l.Allow(ctx, fmt.Sprintf("other-%d", i))
		require.NoError(t, err)
		byStore[d.Store]++
		time.Sleep(5 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	t.Logf("other keys while 8 callers wait on a locked row: %v", byStore)
	require.Zero(t, hotErrs.Load())
	require.Equal(t, 100, byStore[ratelimit.StorePostgres], "a locked row must not open the breaker for every other key")
}

// TestFaultBackendsTerminated kills the pool's backends with
// pg_terminate_backend, over and over, under 8 goroutines' load: no caller
// of a FailToMemory limiter sees an error, some checks fall back to memory,
// and PostgreSQL answers between the kills. The kills come every 30 ms, or
// further apart when the baseline measured first says a new connection
// takes longer than that here (else no check could ever be answered between
// two kills); they go on for 2.5 s, and longer (at most 30 s) until
// PostgreSQL has answered between them.
func TestFaultBackendsTerminated(t *testing.T) {
	c := newCluster(t)
	b := measureBaseline(t, c.url())
	const app = "pgrl-fault-kill"
	timeout := b.timeout()
	pool := faultPool(t, c.url(), app, pgDuration(timeout*8/10))
	admin := faultPool(t, c.url(), "pgrl-fault-admin", "")
	l, err := testkit.New(pool, ratelimit.Config{Name: "kill", Limit: 1_000_000, Window: time.Hour}, ratelimit.DatabaseOptions{Timeout: timeout})
	require.NoError(t, err)
	warmUntilHealthy(t, l)

	st := &loadStats{byStore: map[ratelimit.Store]int{}}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { runLoad(l, 8, stop, st, policyCases[0].check); close(done) }()

	interval := max(30*time.Millisecond, 2*b.cold)
	var killed int64
	started := time.Now()
	ctx := context.Background()
	for {
		var n int64
		err := admin.QueryRow(ctx, "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&n)
		require.NoError(t, err)
		killed += n
		answered := false
		if killed > 0 {
			st.mu.Lock()
			if st.watchFrom.IsZero() {
				st.watchFrom = time.Now()
			}
			answered = !st.firstPostgresAfter.IsZero()
			st.mu.Unlock()
		}
		if elapsed := time.Since(started); (answered && elapsed > 2500*time.Millisecond) || elapsed > 30*time.Second {
			break
		}
		time.Sleep(interval)
	}
	close(stop)
	<-done
	t.Logf("%d backends terminated every %v for %v; %d checks, stores %v, max latency %v (timeout %v)",
		killed, interval, time.Since(started).Round(time.Millisecond), st.checks, st.byStore, st.maxLatency, timeout)
	require.Positive(t, killed, "backends were terminated")
	require.Empty(t, st.errs, "no FailToMemory caller sees an error")
	require.Empty(t, st.wrong)
	require.Positive(t, st.byStore[ratelimit.StoreMemory], "some checks fell back to memory")
	require.False(t, st.firstPostgresAfter.IsZero(), "PostgreSQL answered between the kills")
}

// TestFaultCrashTruncatesUnlogged crashes the throwaway server (pg_ctl stop
// -m immediate). Crash recovery empties the UNLOGGED counter tables (a
// logged table keeps its row, so recovery did run): a key that was
// exhausted is admitted again with fresh counters, by PostgreSQL.
func TestFaultCrashTruncatesUnlogged(t *testing.T) {
	c := newCluster(t)
	pool := faultPool(t, c.url(), "pgrl-fault-crash", "")
	ctx := context.Background()
	_, err := pool.Exec(ctx, "CREATE TABLE crash_witness (id int); INSERT INTO crash_witness VALUES (1)")
	require.NoError(t, err)

	var limiters []*ratelimit.Limiter
	for _, alg := range ratelimit.Algorithms {
		// The decisions are the test's: a cold check of the fresh cluster
		// on a busy machine may outlast the default Timeout.
		l, err := testkit.New(pool, ratelimit.Config{Name: "crash-" + string(alg), Algorithm: alg, Limit: 3, Window: time.Hour,
			OnFailure: ratelimit.FailError, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})
		require.NoError(t, err)
		for range 3 {
			d, err := l.Allow(ctx, "user")
			require.NoError(t, err)
			require.True(t, d.Allowed)
		}
		d, err := l.Allow(ctx, "user")
		require.NoError(t, err)
		require.False(t, d.Allowed, "%s: exhausted before the crash", alg)
		limiters = append(limiters, l)
	}

	c.stop("immediate")
	crashed := time.Now()
	c.start()
	t.Logf("crash recovery took %v", time.Since(crashed).Round(time.Millisecond))

	for _, l := range limiters {
		var d ratelimit.Decision
		require.True(t, settle(func() bool {
			d, err = l.Allow(ctx, "user")
			return err == nil
		}), "%s: checks work after the crash: %v", l.Config().Name, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.True(t, d.Allowed, "%s: fresh counter after the crash", l.Config().Name)
		require.Equal(t, int64(2), d.Remaining, "%s: the counter started from zero", l.Config().Name)
	}
	var witness, counters int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM crash_witness").Scan(&witness))
	require.Equal(t, 1, witness, "the logged table survived: crash recovery ran")
	require.NoError(t, pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM pgrl_fixed_window) + (SELECT count(*) FROM pgrl_token_bucket) + (SELECT count(*) FROM pgrl_sliding_window)").Scan(&counters))
	require.Equal(t, 3, counters, "only the rows written after the crash remain")
}

// TestFaultStandbyGuard points limiters at a real streaming standby made
// with pg_basebackup -R from the throwaway cluster: every algorithm and a
// multi-limit decision give ErrReadOnly, whatever the failure policy.
func TestFaultStandbyGuard(t *testing.T) {
	c := newCluster(t)
	s := c.standby()
	pool := faultPool(t, s.url(), "pgrl-fault-standby", "")
	ctx := context.Background()
	var inRecovery bool
	require.NoError(t, pool.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery))
	require.True(t, inRecovery, "the standby is in recovery")

	var checks []ratelimit.Check
	// One Database: the limits of one AllowAll. A refused write is the
	// setup's error, not a failure of the database: it opens no breaker.
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{})
	require.NoError(t, err)
	for _, alg := range ratelimit.Algorithms {
		for _, pc := range policyCases {
			l, err := limits.Limiter(ratelimit.Config{Name: "standby-" + string(alg) + pc.name, Algorithm: alg, Limit: 5, Window: time.Minute, OnFailure: pc.policy})
			require.NoError(t, err)
			_, err = l.Allow(ctx, "k")
			require.ErrorIs(t, err, ratelimit.ErrReadOnly, "%s/%s", alg, pc.name)
			require.Contains(t, err.Error(), "primary")
			require.Contains(t, err.Error(), "standby")
			if pc.policy == ratelimit.FailToMemory {
				checks = append(checks, ratelimit.Check{Limiter: l, Key: "k"})
			}
		}
	}
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
	require.ErrorIs(t, err, ratelimit.ErrReadOnly)
	_, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, checks...)
	require.ErrorIs(t, err, ratelimit.ErrReadOnly)
}

// proxiedSchema makes a migrated schema on the shared server and a TCP
// proxy to that server, and returns the proxy and a URL through it.
func proxiedSchema(t *testing.T) (*tcpProxy, string) {
	s := dbtest.NewSchema(t)
	dbtest.Migrate(t, s)
	target, err := pgconn.ParseConfig(dbtest.URL())
	require.NoError(t, err)
	addr := fmt.Sprintf("%s:%d", target.Host, target.Port)
	p := newProxy(t, addr)
	return p, strings.Replace(dbtest.URLWithSchema(s), addr, fmt.Sprintf("127.0.0.1:%d", p.port()), 1)
}

// proxyRun is what proxyFault saw.
type proxyRun struct {
	st *loadStats
	// timeout is the deadline the limiter ran with, from the baseline.
	timeout time.Duration
	// slack is how far past timeout a check may answer, from the baseline
	// (late).
	slack time.Duration
	// recovery is how long PostgreSQL took to answer after the proxy
	// healed, and bound how long it may take.
	recovery, bound time.Duration
	// logs is the limiter's log from the moment the proxy broke.
	logs string
}

// proxyFault measures a baseline through the proxy, then runs 8
// goroutines' load through it with a deadline derived from that baseline
// (opts.Timeout), waits until PostgreSQL answers every check of a warm-up
// round, breaks the proxy (mode "cut_and_refuse" or "stall") for a second or
// two deadlines, whichever is longer, so that checks do time out, heals it
// and runs on until PostgreSQL answers again.
func proxyFault(t *testing.T, p *tcpProxy, url, mode string, cfg ratelimit.Config, opts ratelimit.DatabaseOptions) proxyRun {
	b := measureBaseline(t, url)
	run := proxyRun{timeout: b.timeout(), slack: b.late(b.timeout()), bound: b.recoveryBound(opts.BreakerCooldown)}
	logs := &testkit.LogBuffer{}
	pool := faultPool(t, url, "pgrl-fault-proxy", "")
	opts.Logger = slog.New(slog.NewTextHandler(logs, nil))
	opts.Timeout = run.timeout
	l, err := testkit.New(pool, cfg, opts)
	require.NoError(t, err)
	warmUntilHealthy(t, l)
	logs.Reset()
	st := &loadStats{byStore: map[ratelimit.Store]int{}}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { runLoad(l, 8, stop, st, policyCases[0].check); close(done) }()
	time.Sleep(300 * time.Millisecond)
	if mode == "stall" {
		p.stall.Store(true)
	} else {
		p.refuse.Store(true)
		p.cut()
	}
	time.Sleep(max(time.Second, 2*run.timeout))
	p.stall.Store(false)
	p.refuse.Store(false)
	healed := time.Now()
	st.mu.Lock()
	st.watchFrom = healed
	st.mu.Unlock()
	ok := settleWithin(2*run.bound, func() bool {
		st.mu.Lock()
		defer st.mu.Unlock()
		return !st.firstPostgresAfter.IsZero()
	})
	close(stop)
	<-done
	require.True(t, ok, "PostgreSQL answers again")
	require.Positive(t, st.byStore[ratelimit.StoreMemory], "the fault was felt: some checks were answered from memory")
	run.st, run.logs = st, logs.String()
	run.recovery = st.firstPostgresAfter.Sub(healed)
	t.Logf("%s: %d checks, stores %v, max latency %v (timeout %v, slack %v), PostgreSQL answering %v after the proxy healed (bound %v)",
		mode, st.checks, st.byStore, st.maxLatency, run.timeout, run.slack, run.recovery.Round(time.Millisecond), run.bound)
	return run
}

// TestFaultProxyCutRefuseStall puts a TCP proxy between the limiter and the
// shared server and cuts every connection and refuses new ones, then stalls
// (a network partition: nothing comes back, no error either). The client
// deadline alone bounds the stalled checks (statement_timeout cannot: the
// server never sees the statement). The outage is logged once, and
// PostgreSQL answers again within 2 s of the proxy's recovery (more on a
// machine measured slower). The limiter runs with its defaults (coalescing
// on).
func TestFaultProxyCutRefuseStall(t *testing.T) {
	p, url := proxiedSchema(t)
	for _, mode := range []string{"cut_and_refuse", "stall"} {
		t.Run(mode, func(t *testing.T) {
			run := proxyFault(t, p, url, mode, ratelimit.Config{Name: "proxy-" + mode, Limit: 1_000_000, Window: time.Hour},
				ratelimit.DatabaseOptions{BreakerCooldown: 200 * time.Millisecond})
			require.Empty(t, run.st.errs)
			require.Empty(t, run.st.wrong)
			require.LessOrEqual(t, run.st.maxLatency, run.timeout+run.slack, "every check answers within its deadline + slack")
			require.LessOrEqual(t, run.recovery, run.bound)
			require.Equal(t, 1, strings.Count(run.logs, "database unavailable"), "one outage log line:\n%s", run.logs)
			require.Equal(t, 1, strings.Count(run.logs, "database answering again"), "one recovery log line:\n%s", run.logs)
		})
	}
}

// TestFaultStallCoalescedWithinDeadline is TestFaultProxyCutRefuseStall's
// stall with coalescing on (the default). A check queued behind a round
// trip that times out, and then handed the lead of the next batch, must
// still answer within its own deadline (a regression test: the batch was
// once bounded by a fresh Timeout, about 2 × Timeout in all; the slack is
// at most a quarter of the deadline, so that is still caught).
func TestFaultStallCoalescedWithinDeadline(t *testing.T) {
	p, url := proxiedSchema(t)
	run := proxyFault(t, p, url, "stall", ratelimit.Config{Name: "proxy-coalesced", Limit: 1_000_000, Window: time.Hour},
		ratelimit.DatabaseOptions{BreakerCooldown: 200 * time.Millisecond})
	require.Empty(t, run.st.errs)
	require.LessOrEqual(t, run.st.maxLatency, run.timeout+run.slack, "every check answers within its deadline + slack")
}

// TestFaultBreakerProbeAbandoned opens the breaker, then lets the probe's
// caller give up (its context ends during the probe, so the probe records
// neither success nor failure). Once the database is back, the breaker must
// still probe again and close: checks are answered by PostgreSQL within 2 s
// (more on a machine measured slower).
func TestFaultBreakerProbeAbandoned(t *testing.T) {
	p, url := proxiedSchema(t)
	b := measureBaseline(t, url)
	pool := faultPool(t, url, "pgrl-fault-probe", "")
	const cooldown = 100 * time.Millisecond
	timeout := b.timeout()
	l, err := testkit.New(pool, ratelimit.Config{Name: "probe", Limit: 1_000_000, Window: time.Hour}, ratelimit.DatabaseOptions{Timeout: timeout, BreakerThreshold: 1, BreakerCooldown: cooldown, DisableCoalescing: true, Logger: slog.New(slog.NewTextHandler(&testkit.LogBuffer{}, nil))})
	require.NoError(t, err)
	ctx := context.Background()
	// The first check opens a connection through the proxy; wait until
	// PostgreSQL answers rather than assume the first check's deadline is
	// enough for that.
	require.True(t, settleWithin(30*time.Second, func() bool {
		d, err := l.Allow(ctx, "k")
		return err == nil && d.Store == ratelimit.StorePostgres && !l.BreakerOpen()
	}), "PostgreSQL answers through the healthy proxy")

	p.stall.Store(true)
	d, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, ratelimit.StoreMemory, d.Store)
	require.True(t, l.BreakerOpen())
	time.Sleep(2 * cooldown)
	// This check is the probe; its caller's context ends before the
	// stalled database answers.
	cctx, cancel := context.WithTimeout(ctx, timeout/5)
	_, err = l.Allow(cctx, "k")
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)

	p.stall.Store(false)
	healed := time.Now()
	bound := b.recoveryBound(cooldown)
	require.True(t, settleWithin(2*bound, func() bool {
		d, err := l.Allow(ctx, "k")
		return err == nil && d.Store == ratelimit.StorePostgres
	}), "the breaker probes again after an abandoned probe")
	t.Logf("PostgreSQL answering %v after the stall ended (bound %v)", time.Since(healed).Round(time.Millisecond), bound)
	require.LessOrEqual(t, time.Since(healed), bound)
}

// TestFaultDenyCacheOneStatement hammers one key with 8 goroutines after
// PostgreSQL has denied it. The statements that reach PostgreSQL are counted
// by a wrapping DB: once a denial is known, no statement for that key is
// sent until the denial's end (at most one is allowed for).
func TestFaultDenyCacheOneStatement(t *testing.T) {
	pool, _ := dbtest.Pool(t)
	cdb := &countingDB{db: pool}
	const window = time.Second
	l, err := testkit.New(cdb, ratelimit.Config{Name: "hammer", Limit: 5, Window: window})
	require.NoError(t, err)

	// One record per PostgreSQL denial: when the caller started, when the
	// answer came back, and the denial's length.
	type denial struct {
		started, returned time.Time
		retry             time.Duration
		resetAt           time.Time
	}
	var mu sync.Mutex
	var denials []denial
	byStore := map[ratelimit.Store]int{}
	ctx := context.Background()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				d, err := l.Allow(ctx, "hot")
				if err != nil {
					t.Error(err)
					return
				}
				time.Sleep(100 * time.Microsecond)
				mu.Lock()
				byStore[d.Store]++
				if d.Store == ratelimit.StorePostgres && !d.Allowed {
					denials = append(denials, denial{start, time.Now(), d.RetryAfter, d.ResetAt})
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(3500 * time.Millisecond)
	close(stop)
	wg.Wait()

	// Group the denials by window (ResetAt), and in each find the first
	// answer: from then until that denial ends, the cache answers.
	sends := cdb.sent()
	first := map[time.Time]denial{}
	for _, d := range denials {
		if f, ok := first[d.resetAt]; !ok || d.returned.Before(f.returned) {
			first[d.resetAt] = d
		}
	}
	require.GreaterOrEqual(t, len(first), 3, "several deny periods were seen")
	worst := 0
	for _, f := range first {
		until := f.started.Add(f.retry) // the cache's deadline is no earlier
		n := 0
		for _, s := range sends {
			if s.After(f.returned) && s.Before(until) {
				n++
			}
		}
		if n > 1 {
			t.Logf("deny period from %v (answer at +%v) to +%v:", f.started.Format("15:04:05.000000"), f.returned.Sub(f.started), until.Sub(f.started))
			for _, s := range sends {
				if s.After(f.returned) && s.Before(until) {
					t.Logf("  statement at +%v", s.Sub(f.started))
				}
			}
		}
		worst = max(worst, n)
	}
	total := byStore[ratelimit.StorePostgres] + byStore[ratelimit.StoreDenyCache]
	t.Logf("%d checks in %d deny periods: %d statements reached PostgreSQL (%d denials among them), %d answered by the deny cache; at most %d statement(s) in a deny period",
		total, len(first), len(sends), len(denials), byStore[ratelimit.StoreDenyCache], worst)
	require.LessOrEqual(t, worst, 1, "at most one statement per deny period reaches PostgreSQL")
	require.Greater(t, byStore[ratelimit.StoreDenyCache], 10*len(sends), "the cache answered most checks")
}

// errorsAsPg reports whether err carries SQLSTATE code.
func errorsAsPg(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// TestFaultBreakerOneProbeAtATime stalls the database behind an open
// breaker whose cool-down is much shorter than the check deadline. A probe
// that is still waiting for the stalled database has not been abandoned:
// no other probe may start until it ends, so probes are at least a deadline
// apart (a regression test: a probe was forgotten after one cool-down, and
// a stall piled up one more probe, and one more connection, every
// cool-down; a probe that then succeeded could leave the breaker open).
func TestFaultBreakerOneProbeAtATime(t *testing.T) {
	p, url := proxiedSchema(t)
	b := measureBaseline(t, url)
	timeout := b.timeout()
	cooldown := timeout / 10
	cdb := &countingDB{db: faultPool(t, url, "pgrl-fault-probes", "")}
	l, err := testkit.New(cdb, ratelimit.Config{Name: "probes", Limit: 1_000_000, Window: time.Hour}, ratelimit.DatabaseOptions{Timeout: timeout, BreakerThreshold: 1, BreakerCooldown: cooldown, DisableCoalescing: true, Logger: slog.New(slog.NewTextHandler(&testkit.LogBuffer{}, nil))})
	require.NoError(t, err)
	warmUntilHealthy(t, l)

	st := &loadStats{byStore: map[ratelimit.Store]int{}}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { runLoad(l, 8, stop, st, policyCases[0].check); close(done) }()
	p.stall.Store(true)
	stalled := time.Now()
	// The checks already sent when the stall began fail by their deadline;
	// count the probes after that, over four deadlines.
	time.Sleep(2 * timeout)
	from := time.Now()
	time.Sleep(4 * timeout)
	to := time.Now()
	p.stall.Store(false)
	close(stop)
	<-done
	probes := 0
	for _, s := range cdb.sent() {
		if s.After(from) && s.Before(to) {
			probes++
		}
	}
	t.Logf("stall from %v: %d statements sent in %v (deadline %v, cool-down %v); stores %v",
		stalled.Format("15:04:05.000"), probes, to.Sub(from).Round(time.Millisecond), timeout, cooldown, st.byStore)
	require.True(t, l.BreakerOpen() || st.byStore[ratelimit.StoreMemory] > 0, "the stall opened the breaker")
	// One probe at a time, each lasting a deadline: at most 4 in four
	// deadlines, and one more for the probe already running at the start.
	require.LessOrEqual(t, probes, 5, "one probe at a time while the database is stalled")
}
