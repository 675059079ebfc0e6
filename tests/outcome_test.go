package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// The outcome tests make checks fail in each way the docs' table lists
// (docs/CERTAINTY.md), many times, and hold every error's Outcome to the
// counter: a check reported as not consumed must have counted nothing once
// every statement it may have left behind has finished, one reported as
// consumed must have counted its cost, and an unknown one either. Each
// check costs outcomeCost on a key of its own, so the counter says which.

// outcomeCost is the cost of every check the outcome tests make.
const outcomeCost = 7

// outcomeTrials is how many times each failure is made.
const outcomeTrials = 10

// outcomeTally counts one failure mode's trials by outcome.
type outcomeTally struct {
	mu      sync.Mutex
	name    string
	seen    map[ratelimit.Outcome]int
	counted map[ratelimit.Outcome]int // of seen, the trials whose cost was counted
	wrong   []string
}

func newTally(name string) *outcomeTally {
	return &outcomeTally{name: name, seen: map[ratelimit.Outcome]int{}, counted: map[ratelimit.Outcome]int{}}
}

// judge holds err, the error of a check that asked for outcomeCost, to
// delta, what its key's counter gained.
func (o *outcomeTally) judge(t *testing.T, err error, delta int64) {
	t.Helper()
	require.Error(t, err, "%s: the check must fail", o.name)
	out := ratelimit.OutcomeOf(err)
	sentinel := map[ratelimit.Outcome]error{ratelimit.OutcomeNotConsumed: ratelimit.ErrNotConsumed,
		ratelimit.OutcomeConsumed: ratelimit.ErrConsumed, ratelimit.OutcomeUnknown: ratelimit.ErrOutcomeUnknown}[out]
	require.ErrorIs(t, err, sentinel, "%s: errors.Is matches the outcome's sentinel", o.name)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.seen[out]++
	if delta == outcomeCost {
		o.counted[out]++
	}
	ok := delta == 0 && out != ratelimit.OutcomeConsumed ||
		delta == outcomeCost && out != ratelimit.OutcomeNotConsumed
	if !ok {
		o.wrong = append(o.wrong, fmt.Sprintf("said %s, counted %d (%v)", out, delta, err))
	}
}

// report logs the tally and fails on a wrong answer, or when the mode did
// not give the outcome it must (want) in every trial.
func (o *outcomeTally) report(t *testing.T, want ratelimit.Outcome) {
	t.Helper()
	o.reportSome(t, want)
	total := o.seen[0] + o.seen[1] + o.seen[2]
	require.Equal(t, total, o.seen[want], "%s: every trial is %s", o.name, want)
}

// reportSome is report for a mode that gives want in some trials at least,
// and may give a stronger outcome in others (a deadline that passed while
// a connection was still being opened: nothing was sent).
func (o *outcomeTally) reportSome(t *testing.T, want ratelimit.Outcome) {
	t.Helper()
	t.Logf("%s: %d trials: not consumed %d (counted %d), consumed %d (counted %d), unknown %d (counted %d); wrong answers: %d",
		o.name, o.seen[0]+o.seen[1]+o.seen[2],
		o.seen[ratelimit.OutcomeNotConsumed], o.counted[ratelimit.OutcomeNotConsumed],
		o.seen[ratelimit.OutcomeConsumed], o.counted[ratelimit.OutcomeConsumed],
		o.seen[ratelimit.OutcomeUnknown], o.counted[ratelimit.OutcomeUnknown], len(o.wrong))
	require.Empty(t, o.wrong, "%s: wrong answers", o.name)
	require.Positive(t, o.seen[want], "%s: some trials are %s", o.name, want)
}

// outcomeEnv is a migrated schema, an admin pool on it, and what a trial
// needs to lock a key's row and read its counter.
type outcomeEnv struct {
	t      *testing.T
	schema string
	admin  *pgxpool.Pool
}

func newOutcomeEnv(t *testing.T) *outcomeEnv {
	s := dbtest.NewSchema(t)
	dbtest.Migrate(t, s)
	return &outcomeEnv{t: t, schema: s, admin: dbtest.PoolOn(t, s)}
}

// pool opens a pool on the schema named app (application_name), with the
// given run-time parameters.
func (e *outcomeEnv) pool(app string, maxConns int32, params map[string]string) *pgxpool.Pool {
	return dbtest.PoolOn(e.t, e.schema, func(c *pgxpool.Config) {
		c.MaxConns = maxConns
		c.ConnConfig.RuntimeParams["application_name"] = app
		for k, v := range params {
			c.ConnConfig.RuntimeParams[k] = v
		}
	})
}

// count is what the fixed window counted for key under limiter name.
func (e *outcomeEnv) count(name, key string) int64 {
	var n int64
	require.NoError(e.t, e.admin.QueryRow(context.Background(),
		"SELECT coalesce(sum(count), 0) FROM pgrl_fixed_window WHERE key = $1",
		multiprocessHashedKey(name, key)).Scan(&n))
	return n
}

// lock creates key's row (one unit, or more if a try that failed was
// counted) and locks it in a transaction that stays open until unlock is
// called; base is the row's count then.
func (e *outcomeEnv) lock(l *ratelimit.Limiter, key string) (unlock func(), base int64) {
	ctx := context.Background()
	// The key's row is made by a check of a limiter of the same name on the
	// admin pool, with a long Timeout: one of l's own checks could give up
	// at l's short Timeout on a busy machine and still count after base is
	// read, as the trials below show that checks do.
	warm := outcomeLimiter(e.t, e.admin, l.Config().Name, ratelimit.DatabaseOptions{Timeout: time.Minute})
	_, err := warm.Allow(ctx, key, ratelimit.Cost(1))
	require.NoError(e.t, err)
	tx, err := e.admin.Begin(ctx)
	require.NoError(e.t, err)
	tag, err := tx.Exec(ctx, "SELECT 1 FROM pgrl_fixed_window WHERE key = $1 FOR UPDATE",
		multiprocessHashedKey(l.Config().Name, key))
	require.NoError(e.t, err)
	require.EqualValues(e.t, 1, tag.RowsAffected())
	require.NoError(e.t, tx.QueryRow(ctx, "SELECT coalesce(sum(count), 0) FROM pgrl_fixed_window WHERE key = $1",
		multiprocessHashedKey(l.Config().Name, key)).Scan(&base))
	var once sync.Once
	// A rollback that fails found the connection gone, and the
	// transaction with it.
	unlock = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	e.t.Cleanup(unlock)
	return unlock, base
}

// waiting returns the pids of app's backends waiting on a row lock (as
// lock holds), once there are n. Not any lock: a backend that inserts
// waits on a relation's extension lock for a moment on a busy machine,
// and terminated then, its statement may have committed.
func (e *outcomeEnv) waiting(app string, n int) []int32 {
	var pids []int32
	require.Eventually(e.t, func() bool {
		rows, err := e.admin.Query(context.Background(), `SELECT pid FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple')`, app)
		require.NoError(e.t, err)
		pids, err = pgx.CollectRows(rows, pgx.RowTo[int32])
		require.NoError(e.t, err)
		return len(pids) >= n
	}, 20*time.Second, 5*time.Millisecond, "%d of %s's backends wait on a lock", n, app)
	return pids
}

// quiet waits until no backend of app runs a statement: whatever a failed
// check left behind has committed or rolled back.
func (e *outcomeEnv) quiet(app string) {
	require.Eventually(e.t, func() bool {
		var n int
		require.NoError(e.t, e.admin.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state <> 'idle'`, app).Scan(&n))
		return n == 0
	}, 20*time.Second, 5*time.Millisecond, "%s's statements end", app)
}

// outcomeLimiter is a fixed window limiter that returns every error
// (FailError), and whose breaker never opens: the failures are the test's.
func outcomeLimiter(t *testing.T, pool *pgxpool.Pool, name string, opts ratelimit.DatabaseOptions) *ratelimit.Limiter {
	opts.BreakerThreshold = 1 << 30
	l, err := testkit.New(pool, ratelimit.Config{Name: name, Algorithm: ratelimit.FixedWindow, Limit: 1 << 40,
		Window: time.Hour, OnFailure: ratelimit.FailError}, opts)
	require.NoError(t, err)
	return l
}

// TestOutcomeNothingSent: checks that end before their statement goes out
// (the caller's context already over; waiting for a connection of the
// pool's share or in the coalescer's queue) are not consumed.
func TestOutcomeNothingSent(t *testing.T) {
	t.Parallel()
	e := newOutcomeEnv(t)
	ctx := context.Background()

	t.Run("context_over_before_sending", func(t *testing.T) {
		// Not coalesced: a coalesced check goes out with its batch, under
		// the batch's own deadline, and is answered.
		l := outcomeLimiter(t, e.pool("pgrl-outcome-before", 4, nil), "before",
			ratelimit.DatabaseOptions{DisableCoalescing: true})
		o := newTally("context over before sending")
		for i := range outcomeTrials {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			key := fmt.Sprintf("k%d", i)
			_, err := l.Allow(cctx, key, ratelimit.Cost(outcomeCost))
			o.judge(t, err, e.count("before", key))
		}
		o.report(t, ratelimit.OutcomeNotConsumed)
	})

	t.Run("waiting_for_a_connection_or_a_batch", func(t *testing.T) {
		// A pool of 2: the share holds 1 connection, which a check of a
		// locked row keeps.
		const app = "pgrl-outcome-queue"
		l := outcomeLimiter(t, e.pool(app, 2, nil), "queue", ratelimit.DatabaseOptions{Timeout: time.Minute})
		unlock, _ := e.lock(l, "hot")
		held := make(chan error, 1)
		go func() {
			_, err := l.Allow(ctx, "hot", ratelimit.Cost(outcomeCost))
			held <- err
		}()
		e.waiting(app, 1)
		o := newTally("waiting for a connection or a batch")
		for i := range outcomeTrials {
			cctx, cancel := context.WithTimeout(ctx, time.Duration(20+rand.IntN(40))*time.Millisecond)
			key := fmt.Sprintf("k%d", i)
			_, err := l.Allow(cctx, key, ratelimit.Cost(outcomeCost))
			cancel()
			o.judge(t, err, e.count("queue", key))
		}
		unlock()
		require.NoError(t, <-held)
		e.quiet(app)
		o.report(t, ratelimit.OutcomeNotConsumed)
	})
}

// TestOutcomeServerRolledBack: checks the server ends with an error
// (statement_timeout, lock_timeout) or by ending the backend
// (pg_terminate_backend) while they wait on a locked row, alone or in a
// coalesced batch, are not consumed.
func TestOutcomeServerRolledBack(t *testing.T) {
	t.Parallel()
	e := newOutcomeEnv(t)
	ctx := context.Background()

	for _, param := range []string{"statement_timeout", "lock_timeout"} {
		t.Run(param, func(t *testing.T) {
			app := "pgrl-outcome-" + param
			l := outcomeLimiter(t, e.pool(app, 4, map[string]string{param: "50ms"}), param,
				ratelimit.DatabaseOptions{Timeout: 10 * time.Second})
			o := newTally(param + " while waiting on a row lock")
			for i := range outcomeTrials {
				key := fmt.Sprintf("k%d", i)
				unlock, base := e.lock(l, key)
				_, err := l.Allow(ctx, key, ratelimit.Cost(outcomeCost))
				unlock()
				e.quiet(app)
				o.judge(t, err, e.count(param, key)-base)
			}
			o.report(t, ratelimit.OutcomeNotConsumed)
		})
	}

	t.Run("backend_terminated", func(t *testing.T) {
		const app = "pgrl-outcome-terminated"
		l := outcomeLimiter(t, e.pool(app, 4, nil), "terminated", ratelimit.DatabaseOptions{Timeout: time.Minute})
		o := newTally("backend terminated while waiting on a row lock")
		for i := range outcomeTrials {
			key := fmt.Sprintf("k%d", i)
			unlock, base := e.lock(l, key)
			done := make(chan error, 1)
			go func() {
				_, err := l.Allow(ctx, key, ratelimit.Cost(outcomeCost))
				done <- err
			}()
			pids := e.waiting(app, 1)
			_, err := e.admin.Exec(ctx, "SELECT pg_terminate_backend($1)", pids[0])
			require.NoError(t, err)
			err = <-done
			unlock()
			e.quiet(app)
			o.judge(t, err, e.count("terminated", key)-base)
		}
		o.report(t, ratelimit.OutcomeNotConsumed)
	})

	t.Run("coalesced_batch_terminated", func(t *testing.T) {
		// One round trip at a time: of 12 checks made at once, one goes
		// out, the others queue and go out together as it ends, one
		// statement. One key's row is locked, so the statement that holds
		// it waits, and its backend is terminated in the middle of it.
		// Every check of that statement fails, and none is consumed. The
		// locked key's check is started at another place in each trial:
		// started first, on a busy machine it went out first and alone
		// in every trial.
		const app = "pgrl-outcome-batch"
		l := outcomeLimiter(t, e.pool(app, 4, nil), "batch",
			ratelimit.DatabaseOptions{Timeout: time.Minute, MaxInFlight: 1})
		o := newTally("coalesced batch terminated mid-statement")
		largest := 0
		for i := range outcomeTrials {
			locked := fmt.Sprintf("locked%d", i)
			unlock, base := e.lock(l, locked)
			var keys []string
			for j := range 11 {
				keys = append(keys, fmt.Sprintf("b%d-%d", i, j))
			}
			at := (i*5 + 3) % 12 // 3, 8, 1, 6, 11, 4, 9, 2, 7, 0
			keys = slices.Insert(keys, at, locked)
			errs := make([]error, len(keys))
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for j, k := range keys {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-gate
					_, errs[j] = l.Allow(ctx, k, ratelimit.Cost(outcomeCost))
				}()
			}
			close(gate)
			pids := e.waiting(app, 1)
			_, err := e.admin.Exec(ctx, "SELECT pg_terminate_backend($1)", pids[0])
			require.NoError(t, err)
			wg.Wait()
			unlock()
			e.quiet(app)
			failed := 0
			for j, k := range keys {
				delta := e.count("batch", k)
				if j == at {
					delta -= base // the locked row's count before the batch
				}
				if errs[j] == nil {
					require.EqualValues(t, outcomeCost, delta, "a check that succeeded counted its cost")
					continue
				}
				failed++
				o.judge(t, errs[j], delta)
			}
			largest = max(largest, failed)
		}
		t.Logf("the largest statement cut held %d checks", largest)
		require.GreaterOrEqual(t, largest, 2, "a statement of several coalesced checks was cut")
		o.report(t, ratelimit.OutcomeNotConsumed)
	})
}

// TestOutcomeLostAfterSending: a check whose answer is lost after its
// statement went out (the client's deadline while it waits on a locked
// row, or its connection cut) is unknown: released a moment later, the
// statement goes on and usually counts.
func TestOutcomeLostAfterSending(t *testing.T) {
	t.Parallel()
	e := newOutcomeEnv(t)
	ctx := context.Background()

	t.Run("client_deadline", func(t *testing.T) {
		const app = "pgrl-outcome-deadline"
		l := outcomeLimiter(t, e.pool(app, 4, nil), "deadline", ratelimit.DatabaseOptions{Timeout: 100 * time.Millisecond})
		o := newTally("client deadline while waiting on a row lock")
		for i := range outcomeTrials {
			key := fmt.Sprintf("k%d", i)
			unlock, base := e.lock(l, key)
			_, err := l.Allow(ctx, key, ratelimit.Cost(outcomeCost))
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			unlock()
			e.quiet(app)
			o.judge(t, err, e.count("deadline", key)-base)
		}
		o.reportSome(t, ratelimit.OutcomeUnknown)
	})

	t.Run("connection_cut", func(t *testing.T) {
		p, url := proxiedSchema(t)
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.MaxConns = 4
		const app = "pgrl-outcome-cut"
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		var schema string
		require.NoError(t, pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema))
		ce := &outcomeEnv{t: t, schema: schema, admin: dbtest.PoolOn(t, schema)}
		l := outcomeLimiter(t, pool, "cut", ratelimit.DatabaseOptions{Timeout: time.Minute})
		o := newTally("connection cut while waiting on a row lock")
		for i := range outcomeTrials {
			key := fmt.Sprintf("k%d", i)
			unlock, base := ce.lock(l, key)
			done := make(chan error, 1)
			go func() {
				_, err := l.Allow(ctx, key, ratelimit.Cost(outcomeCost))
				done <- err
			}()
			ce.waiting(app, 1)
			p.cut()
			err := <-done
			unlock()
			ce.quiet(app)
			o.judge(t, err, ce.count("cut", key)-base)
		}
		o.report(t, ratelimit.OutcomeUnknown)
	})
}

// TestOutcomeServerStopped stops a throwaway server (pg_ctl stop -m fast)
// while a check waits on a locked row, and checks while it is down: the
// first is ended by the server before it commits, the others never reach
// it; none is consumed, as the counters read after a restart show (a
// clean shutdown keeps UNLOGGED tables).
func TestOutcomeServerStopped(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(c.url())
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	const app = "pgrl-outcome-stop"
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	admin, err := pgxpool.New(ctx, c.url())
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	e := &outcomeEnv{t: t, admin: admin}
	l := outcomeLimiter(t, pool, "stop", ratelimit.DatabaseOptions{Timeout: 5 * time.Second})

	o := newTally("server stopped (fast) while waiting, and checks while it is down")
	decided := 0
	for i := range 3 {
		key := fmt.Sprintf("k%d", i)
		_, base := e.lock(l, key)
		done := make(chan error, 1)
		go func() {
			_, err := l.Allow(ctx, key, ratelimit.Cost(outcomeCost))
			done <- err
		}()
		e.waiting(app, 1)
		admin.Reset()
		c.stop("fast")
		errWaiting := <-done
		down := fmt.Sprintf("down%d", i)
		_, errDown := l.Allow(ctx, down, ratelimit.Cost(outcomeCost))
		c.start()
		if errWaiting == nil {
			// The shutdown ended the lock holder's backend first, and the
			// check's got the row and committed before its own turn came:
			// a decision, counted.
			require.Equal(t, int64(outcomeCost), e.count("stop", key)-base, "a check that answered counted")
			decided++
		} else {
			o.judge(t, errWaiting, e.count("stop", key)-base)
		}
		o.judge(t, errDown, e.count("stop", down))
	}
	t.Logf("%d of the checks waiting on a lock were decided before the shutdown ended them", decided)
	o.report(t, ratelimit.OutcomeNotConsumed)
}

// TestOutcomeInCallersTransaction: a check in the caller's transaction
// that fails is not consumed, whatever the failure: the transaction can no
// longer commit.
func TestOutcomeInCallersTransaction(t *testing.T) {
	t.Parallel()
	e := newOutcomeEnv(t)
	ctx := context.Background()
	const app = "pgrl-outcome-tx"
	pool := e.pool(app, 4, nil)
	l := outcomeLimiter(t, pool, "tx", ratelimit.DatabaseOptions{})
	o := newTally("client deadline inside the caller's transaction")
	for i := range outcomeTrials {
		key := fmt.Sprintf("k%d", i)
		unlock, base := e.lock(l, key)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err = l.AllowTx(cctx, tx, key, ratelimit.Cost(outcomeCost))
		cancel()
		_ = tx.Rollback(ctx)
		unlock()
		e.quiet(app)
		o.judge(t, err, e.count("tx", key)-base)
		require.False(t, errors.Is(err, ratelimit.ErrOutcomeUnknown))
	}
	o.report(t, ratelimit.OutcomeNotConsumed)
}
