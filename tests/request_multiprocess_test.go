package tests

import (
	"bufio"
	"context"
	"encoding/json"
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

// requestChildEnv carries the database URL to the child processes of
// TestRequestIDMultiprocess.
const requestChildEnv = "PGRL_REQUEST_CHILD_URL"

const (
	requestIDs     = 200 // distinct request ids, each sent by every process
	requestLimit   = 60  // what the key admits: less than the demand
	requestApp     = "pgrl-request-child"
	requestLimiter = "request-ids"
	requestKey     = "hot"
	// requestAttempts bounds the attempts of one copy. The terminator
	// ends at most two backends per id stored, so no run of terminations
	// can exhaust it: a copy that gives up failed for another reason.
	requestAttempts = 2*requestIDs + 10
)

// requestReport is what one child process saw.
type requestReport struct {
	Allowed  map[int]bool `json:"allowed"`  // each id's decision
	Replayed int          `json:"replayed"` // decisions that were replays
	Errors   int          `json:"errors"`   // failed attempts, retried
	Outcomes map[string]int
	GaveUp   int    `json:"gave_up"`
	Error    string `json:"error,omitempty"`
}

// TestRequestIDChildProcess is not a test of its own: run by
// TestRequestIDMultiprocess as one of its processes, it answers "RUN SEED"
// by sending every request id 1 to 5 times, in a random order, from 8
// goroutines, retrying an attempt that fails with the same id, and reports
// each id's decision.
func TestRequestIDChildProcess(t *testing.T) {
	url := os.Getenv(requestChildEnv)
	if url == "" {
		t.Skip("a process of TestRequestIDMultiprocess")
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["application_name"] = requestApp
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	lim, err := testkit.New(pool, ratelimit.Config{Name: requestLimiter, Algorithm: ratelimit.FixedWindow,
		Limit: requestLimit, Window: time.Hour, OnFailure: ratelimit.FailError, DenyCacheSize: -1},
		ratelimit.DatabaseOptions{BreakerThreshold: 1 << 30, Timeout: 5 * time.Second})
	require.NoError(t, err)
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) != 2 || f[0] != "RUN" {
			continue
		}
		seed, _ := strconv.ParseUint(f[1], 10, 64)
		rng := rand.New(rand.NewPCG(seed, 1))
		var work []int
		for id := range requestIDs {
			for range 1 + rng.IntN(5) {
				work = append(work, id)
			}
		}
		rng.Shuffle(len(work), func(i, j int) { work[i], work[j] = work[j], work[i] })
		r := requestReport{Allowed: map[int]bool{}, Outcomes: map[string]int{}}
		var mu sync.Mutex
		var next atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= len(work) {
						return
					}
					id := work[i]
					var d ratelimit.Decision
					var err error
					for range requestAttempts {
						d, err = lim.Allow(ctx, requestKey, ratelimit.RequestID(fmt.Sprint("request-", id)))
						if err == nil {
							break
						}
						mu.Lock()
						r.Errors++
						r.Outcomes[ratelimit.OutcomeOf(err).String()]++
						mu.Unlock()
					}
					mu.Lock()
					switch {
					case err != nil:
						r.GaveUp++
						r.Error = err.Error()
					default:
						if prev, ok := r.Allowed[id]; ok && prev != d.Allowed {
							r.Error = fmt.Sprintf("request %d: allowed %v, then %v", id, prev, d.Allowed)
						}
						r.Allowed[id] = d.Allowed
						if d.Replayed {
							r.Replayed++
						}
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		b, _ := json.Marshal(r)
		fmt.Println(string(b))
	}
}

// Several OS processes send each of 200 request ids 1 to 5 times, from 8
// goroutines each, while their connections are terminated at random
// (pg_terminate_backend), retrying each failed attempt with the same id.
// Every process gets one decision per id, the same in all of them, and the
// counter equals the number of distinct ids admitted: exactly the limit.
func TestRequestIDMultiprocess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	cctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()

	const processes = 4
	children := make([]*child, processes)
	for i := range children {
		children[i] = startChild(t, cctx, "TestRequestIDChildProcess", requestChildEnv+"="+dbtest.URLWithSchema(s))
	}
	// Terminate the children's backends at random as they go.
	defer logActivityBefore(t, cctx, pool, requestApp)()
	stopKilling := terminateAtRandom(ctx, pool, requestApp, 2)
	for i, c := range children {
		c.send(t, fmt.Sprint("RUN ", i+1))
	}
	reports := make([]requestReport, processes)
	for i, c := range children {
		c.read(t, &reports[i])
	}
	killed := stopKilling()

	admitted := map[int]bool{}
	for i, r := range reports {
		require.Empty(t, r.Error, "process %d", i)
		require.Zero(t, r.GaveUp, "process %d gave up on a request", i)
		require.Len(t, r.Allowed, requestIDs, "process %d decided every id", i)
		t.Logf("process %d: %d replays, %d failed attempts retried %v", i, r.Replayed, r.Errors, r.Outcomes)
		for id, ok := range r.Allowed {
			if prev, seen := admitted[id]; seen {
				require.Equal(t, prev, ok, "request %d: every process has the first decision", id)
			}
			admitted[id] = ok
		}
	}
	n := 0
	for _, ok := range admitted {
		if ok {
			n++
		}
	}
	var count int64
	require.NoError(t, pool.QueryRow(ctx, "SELECT coalesce(sum(count), 0) FROM pgrl_fixed_window WHERE key = $1",
		multiprocessHashedKey(requestLimiter, requestKey)).Scan(&count))
	var stored int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_request").Scan(&stored))
	t.Logf("%d backends terminated; %d ids admitted of %d; counter %d; %d answers stored", killed, n, requestIDs, count, stored)
	require.Positive(t, killed, "connections were killed")
	require.EqualValues(t, n, count, "the counter equals the distinct ids admitted")
	require.Equal(t, requestLimit, n, "the limit admits exactly its limit of distinct ids")
	require.Equal(t, requestIDs, stored, "one answer per id")
}
