package tests

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// settleChildEnv carries the database URL to the child processes of
// TestSettleMultiprocess.
const settleChildEnv = "PGRL_SETTLE_CHILD_URL"

const (
	settleIDs     = 150 // reservations per process
	settleLimit   = 15000
	settleApp     = "pgrl-settle-child-"
	settleLimiter = "reservations"
	settleKey     = "llm"
	settleProcs   = 4
	// settleAttempts bounds the attempts of one call. The terminator ends
	// at most one backend per reservation made, so no run of
	// terminations can exhaust it: a call that gives up failed for
	// another reason.
	settleAttempts = settleProcs*settleIDs + 10
)

// settlePlan is what a reservation does, the same in every process that
// computes it: reserve estimate units, then settle with actual, never
// (settles 0), once or twice (the second time with another figure, which
// must change nothing).
type settlePlan struct {
	estimate, actual int64
	settles          int
}

func settlePlanOf(proc, i int) settlePlan {
	rng := rand.New(rand.NewPCG(uint64(proc)+1, uint64(i)+1))
	p := settlePlan{estimate: 1 + rng.Int64N(100), actual: rng.Int64N(160), settles: 1}
	switch r := rng.IntN(10); {
	case r == 0:
		p.settles = 0
	case r <= 2:
		p.settles = 2
	}
	return p
}

func settleID(proc, i int) string { return fmt.Sprintf("job-%d-%d", proc, i) }

// settleResult is what became of one reservation in the process that made
// it.
type settleResult struct {
	Allowed bool  `json:"allowed"`
	Settled bool  `json:"settled"`
	Actual  int64 `json:"actual"` // as the settlement stored it
}

// settleReport is what one child process saw.
type settleReport struct {
	Results  map[int]settleResult `json:"results"`
	Errors   int                  `json:"errors"` // failed attempts, retried
	Outcomes map[string]int       `json:"outcomes"`
	Error    string               `json:"error,omitempty"`
}

// retry calls f until it succeeds, at most settleAttempts times, counting
// the failures in r.
func (r *settleReport) retry(mu *sync.Mutex, f func() error) error {
	var err error
	for range settleAttempts {
		if err = f(); err == nil {
			return nil
		}
		mu.Lock()
		r.Errors++
		r.Outcomes[ratelimit.OutcomeOf(err).String()]++
		mu.Unlock()
	}
	return err
}

// settleLimiterOn is the limiter every process of TestSettleMultiprocess
// uses, on a pool named app.
func settleLimiterOn(t *testing.T, url, app string) (*ratelimit.Limiter, *pgxpool.Pool) {
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	// Day-long windows: a run does not straddle a window's end but once
	// in thousands.
	lim, err := testkit.New(pool, ratelimit.Config{Name: settleLimiter, Algorithm: ratelimit.FixedWindow,
		Limit: settleLimit, Window: 24 * time.Hour, OnFailure: ratelimit.FailError, DenyCacheSize: -1},
		ratelimit.DatabaseOptions{BreakerThreshold: 1 << 30, Timeout: 5 * time.Second})
	require.NoError(t, err)
	return lim, pool
}

// TestSettleChildProcess is not a test of its own: run by
// TestSettleMultiprocess as one of its processes, it answers "RUN PROC
// PACE" by making process PROC's reservations from 4 goroutines (from one,
// PACE milliseconds apart, when PACE is not 0), each reserved and then
// settled as its plan says, every failed call retried with the same id,
// and reports what became of each.
func TestSettleChildProcess(t *testing.T) {
	url := os.Getenv(settleChildEnv)
	if url == "" {
		t.Skip("a process of TestSettleMultiprocess")
	}
	ctx := context.Background()
	in := bufio.NewScanner(os.Stdin)
	fmt.Println("ready")
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) != 3 || f[0] != "RUN" {
			continue
		}
		proc, _ := strconv.Atoi(f[1])
		pace, _ := strconv.Atoi(f[2])
		workers := 4
		if pace > 0 {
			workers = 1
		}
		lim, pool := settleLimiterOn(t, url, settleApp+f[1])
		r := settleReport{Results: map[int]settleResult{}, Outcomes: map[string]int{}}
		var mu sync.Mutex
		var next atomic.Int64
		var wg sync.WaitGroup
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= settleIDs {
						return
					}
					time.Sleep(time.Duration(pace) * time.Millisecond)
					p, id := settlePlanOf(proc, i), settleID(proc, i)
					var res settleResult
					err := r.retry(&mu, func() error {
						d, err := lim.Reserve(ctx, settleKey, id, p.estimate)
						res.Allowed = d.Allowed
						return err
					})
					for n := range p.settles {
						if err != nil {
							break
						}
						err = r.retry(&mu, func() error {
							s, err := lim.Settle(ctx, settleKey, id, p.actual+int64(n)*7)
							switch {
							case err != nil:
								return err
							case n == 1 && (!s.Replayed || s.Actual != res.Actual):
								return fmt.Errorf("%s: settled again with %+v, first %+v", id, s, res)
							}
							res.Settled, res.Actual = true, s.Actual
							return nil
						})
					}
					mu.Lock()
					if err != nil {
						r.Error = err.Error()
					}
					r.Results[i] = res
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		pool.Close()
		b, _ := json.Marshal(r)
		fmt.Println(string(b))
	}
}

// Several OS processes each make 150 reservations of one key with random
// estimates and settle them with random actual costs, some never, some
// twice, while their connections are terminated at random
// (pg_terminate_backend) and every failed call is retried with the same
// id. One process is killed (SIGKILL) in the middle; this process settles
// its reservations afterwards. The key's counter is then, exactly, the
// sum of the settled actual costs plus the estimates of the allowed
// reservations never settled.
func TestSettleMultiprocess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	cctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()

	const processes = settleProcs
	url := dbtest.URLWithSchema(s)
	children := make([]*child, processes)
	for i := range children {
		children[i] = startChild(t, cctx, "TestSettleChildProcess", settleChildEnv+"="+url)
	}
	defer logActivityBefore(t, cctx, pool, settleApp+"%")()
	stopKilling := terminateAtRandom(ctx, pool, settleApp+"%", 1)
	// Process 0 goes slowly, and dies with reservations made, some
	// settled, some not, once the others have made 100.
	children[0].send(t, "RUN 0 10")
	for i, c := range children[1:] {
		c.send(t, fmt.Sprint("RUN ", i+1, " 0"))
	}
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_request").Scan(&n) == nil && n >= 100
	}, time.Minute, 5*time.Millisecond)
	// And process 0 has made its first reservation (its one goroutine may
	// have seen every attempt terminated until now). The stored id is
	// ratelimit's hash of the reservation id.
	first := sha256.Sum256([]byte("pgrl reserve\x00" + settleID(0, 0)))
	require.Eventually(t, func() bool {
		var ok bool
		return pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pgrl_request WHERE id = $1)", first[:16]).Scan(&ok) == nil && ok
	}, time.Minute, 5*time.Millisecond, "process 0 made its first reservation")
	time.Sleep(time.Duration(150+rand.IntN(200)) * time.Millisecond)
	require.NoError(t, children[0].cmd.Process.Kill())
	reports := make([]settleReport, processes)
	for i, c := range children[1:] {
		c.read(t, &reports[i+1])
	}
	killed := stopKilling()
	// Its statements may still be running: wait for its backends to end,
	// so that no reservation of it commits after this process looked.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
			settleApp+"0").Scan(&n))
		return n == 0
	}, time.Minute, 20*time.Millisecond)

	// Settle what process 0 reserved: each reservation it made, whether it
	// settled it or not, settles here (or is found settled).
	lim, own := settleLimiterOn(t, url, "pgrl-settle-parent")
	defer own.Close()
	r0 := settleReport{Results: map[int]settleResult{}, Outcomes: map[string]int{}}
	var mu sync.Mutex
	found, notFound := 0, 0
	for i := range settleIDs {
		p := settlePlanOf(0, i)
		err := r0.retry(&mu, func() error {
			s, err := lim.Settle(ctx, settleKey, settleID(0, i), p.actual)
			switch {
			case errors.Is(err, ratelimit.ErrReservationNotFound):
				notFound++ // never reserved: it counted nothing
				return nil
			case err == nil:
				found++
				r0.Results[i] = settleResult{Settled: true, Actual: s.Actual}
			}
			return err
		})
		require.NoError(t, err)
	}
	reports[0] = r0

	var want int64
	for proc, r := range reports {
		require.Empty(t, r.Error, "process %d", proc)
		if proc > 0 {
			require.Len(t, r.Results, settleIDs, "process %d made every reservation", proc)
		}
		for i, res := range r.Results {
			p := settlePlanOf(proc, i)
			switch {
			case res.Settled:
				require.Equal(t, p.actual, res.Actual, "%s: the first settlement's actual cost", settleID(proc, i))
				want += res.Actual
			case res.Allowed:
				want += p.estimate // never settled: it counts its estimate
			}
		}
		t.Logf("process %d: %d failed calls retried %v", proc, r.Errors, r.Outcomes)
	}
	var count int64
	require.NoError(t, pool.QueryRow(ctx, "SELECT coalesce(sum(count), 0) FROM pgrl_fixed_window WHERE key = $1",
		multiprocessHashedKey(settleLimiter, settleKey)).Scan(&count))
	t.Logf("%d backends terminated; process 0 killed with %d reservations made, %d not; counter %d",
		killed, found, notFound, count)
	require.Positive(t, killed, "connections were terminated")
	require.Positive(t, found, "process 0 had made reservations when it was killed")
	require.Positive(t, notFound, "process 0 was killed before its last reservation")
	require.Equal(t, want, count, "the counter is the settled costs plus the unsettled estimates")
}
