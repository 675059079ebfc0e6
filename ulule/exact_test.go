package ulule_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/ulule/limiter/v3"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ulule"
)

// An exactness check that ulule's suite lacks: its concurrency test only
// looks for errors. Here several goroutines in several OS processes
// increment a few keys by random amounts; afterwards the counters in the
// table must hold exactly the sum of the calls, and the totals the calls
// saw must line up, per key and window, as one serial order (each total is
// the previous one plus the call's own increment): no hit lost, none
// counted twice, no two calls answered from the same state.

// exactRate has a limit so high that Remaining = Limit - count always, so
// each answer reveals the exact count after its call.
var exactRate = limiter.Rate{Period: time.Hour, Limit: 1 << 50}

// exactCall is one Increment: its key, its increment, and what it saw.
type exactCall struct {
	Key   string `json:"key"`
	Inc   int64  `json:"inc"`
	Total int64  `json:"total"` // count after the call
	Reset int64  `json:"reset"` // window end, Unix seconds
}

// hammer runs workers goroutines of calls Increments each over keys keys
// and returns what each call saw.
func hammer(ctx context.Context, s limiter.Store, workers, calls, keys int) ([]exactCall, error) {
	var (
		mu    sync.Mutex
		out   []exactCall
		first error
		wg    sync.WaitGroup
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), uint64(os.Getpid())))
			local := make([]exactCall, 0, calls)
			for range calls {
				c := exactCall{Key: "k" + strconv.Itoa(r.IntN(keys)), Inc: 1 + r.Int64N(3)}
				lc, err := s.Increment(ctx, c.Key, c.Inc, exactRate)
				if err != nil {
					mu.Lock()
					first = err
					mu.Unlock()
					return
				}
				c.Total, c.Reset = lc.Limit-lc.Remaining, lc.Reset
				local = append(local, c)
			}
			mu.Lock()
			out = append(out, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out, first
}

// checkExact checks the calls against each other and against the table.
func checkExact(t *testing.T, pool *pgxpool.Pool, calls []exactCall) {
	t.Helper()
	type win struct {
		key   string
		reset int64
	}
	groups := map[win][]exactCall{}
	var sum int64
	for _, c := range calls {
		w := win{c.Key, c.Reset}
		groups[w] = append(groups[w], c)
		sum += c.Inc
	}
	for w, g := range groups {
		sort.Slice(g, func(i, j int) bool { return g[i].Total < g[j].Total })
		var prev int64
		for _, c := range g {
			if c.Total != prev+c.Inc {
				t.Fatalf("key %s window %d: a call of %d saw %d after %d: not one serial order", w.key, w.reset, c.Inc, c.Total, prev)
			}
			prev = c.Total
		}
	}
	var stored int64
	if err := pool.QueryRow(context.Background(), "SELECT coalesce(sum(count), 0)::bigint FROM pgrl_fixed_window").Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if stored != sum {
		t.Fatalf("table holds %d hits, the calls made %d", stored, sum)
	}
	t.Logf("%d calls, %d hits, %d key-windows: exact", len(calls), sum, len(groups))
}

func TestExactGoroutines(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(8))
	s, err := ulule.NewStoreWithOptions(pool, ulule.Options{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	calls, err := hammer(context.Background(), s, 16, 150, 3)
	if err != nil {
		t.Fatal(err)
	}
	checkExact(t, pool, calls)
}

// helperEnv names the variable that turns this test binary into one of the
// processes of TestExactProcesses; its value is the database URL.
const helperEnv = "PGRL_ULULE_EXACT_HELPER_URL"

func TestExactProcesses(t *testing.T) {
	t.Parallel()
	pool, schemaName := dbtest.Pool(t)
	const procs, workers, each = 4, 8, 100
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		calls []exactCall
	)
	errs := make(chan error, procs)
	for range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command(os.Args[0], "-test.run=^TestExactHelperProcess$", "-test.count=1")
			cmd.Env = append(os.Environ(), helperEnv+"="+dbtest.URLWithSchema(schemaName),
				"PGRL_ULULE_EXACT_WORKERS="+strconv.Itoa(workers), "PGRL_ULULE_EXACT_CALLS="+strconv.Itoa(each))
			out, err := cmd.Output()
			if err != nil {
				errs <- fmt.Errorf("helper process: %w\n%s", err, out)
				return
			}
			sc := bufio.NewScanner(bytes.NewReader(out))
			var got []exactCall
			for sc.Scan() {
				var c exactCall
				if json.Unmarshal(sc.Bytes(), &c) == nil && c.Key != "" {
					got = append(got, c)
				}
			}
			if len(got) != workers*each {
				errs <- fmt.Errorf("a helper process reported %d calls, want %d:\n%s", len(got), workers*each, out)
				return
			}
			mu.Lock()
			calls = append(calls, got...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	checkExact(t, pool, calls)
}

// TestExactHelperProcess is one process of TestExactProcesses; it does
// nothing when run by itself.
func TestExactHelperProcess(t *testing.T) {
	url := os.Getenv(helperEnv)
	if url == "" {
		return
	}
	workers, _ := strconv.Atoi(os.Getenv("PGRL_ULULE_EXACT_WORKERS"))
	each, _ := strconv.Atoi(os.Getenv("PGRL_ULULE_EXACT_CALLS"))
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// The counts must be exact, so a check waits for PostgreSQL as long
	// as the test runs: on a loaded machine the default Timeout would hand
	// a late answer to the failure policy, which is not a wrong count.
	s, err := ulule.NewStoreWithOptions(pool, ulule.Options{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	calls, err := hammer(ctx, s, workers, each, 3)
	if err != nil {
		t.Fatal(err)
	}
	enc := json.NewEncoder(os.Stdout)
	for _, c := range calls {
		_ = enc.Encode(c)
	}
}
