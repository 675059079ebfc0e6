// Command ulbench compares two stores of github.com/ulule/limiter/v3 on the
// same machine, in one run, with the same callers and keys: ulule's Redis
// store and pgrl's PostgreSQL store (package github.com/pgrl/pgrl/ulule).
//
// For each number of concurrent callers (--callers, default 1,8,32) it runs
// both stores in alternating slices (--slices, default 4, of --duration
// split evenly), so that noise from other work on the machine falls on both
// alike. Each caller loops on limiter.Get with a key drawn at random from
// --keys keys; the limit is so high that every call is counted and none is
// reached. Both stores get a connection pool of as many connections as
// callers. The report gives ops/s, p50 and p99 latency per store and the
// ratio pgrl/redis.
//
//	ulbench --duration 8s --callers 1,8,32
//	ulbench --output json > ulbench.json
//
// The counter table lives in --schema (default pgrl_ululebench), created
// and migrated; the Redis keys are "ulbench:key-N" in --redis-db. Drop the
// schema when done: DROP SCHEMA pgrl_ululebench CASCADE.
//
// Exit status: 0 when the benchmark ran, 1 on a runtime error, 2 on bad
// flags.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	libredis "github.com/redis/go-redis/v9"
	"github.com/ulule/limiter/v3"
	sredis "github.com/ulule/limiter/v3/drivers/store/redis"

	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ulule"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// result is one store's figures for one number of callers.
type result struct {
	Store   string  `json:"store"`
	Callers int     `json:"callers"`
	Ops     int     `json:"ops"`
	OpsPerS float64 `json:"ops_per_s"`
	P50us   float64 `json:"p50_us"`
	P99us   float64 `json:"p99_us"`
}

type options struct {
	dbURL, redisAddr, schema, output string
	redisDB, keys, slices            int
	callers                          []int
	duration                         time.Duration
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("ulbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	var callers string
	fs.StringVar(&o.dbURL, "database-url", "", "PostgreSQL connection string (default: $DATABASE_URL, else the PG* variables)")
	fs.StringVar(&o.redisAddr, "redis-addr", "127.0.0.1:6379", "Redis host:port")
	fs.IntVar(&o.redisDB, "redis-db", 0, "Redis database number")
	fs.StringVar(&o.schema, "schema", "pgrl_ululebench", "schema for pgrl's counter table (created and migrated)")
	fs.StringVar(&callers, "callers", "1,8,32", "comma-separated numbers of concurrent callers")
	fs.IntVar(&o.keys, "keys", 10000, "number of distinct keys the callers draw from")
	fs.DurationVar(&o.duration, "duration", 8*time.Second, "time per store and number of callers")
	fs.IntVar(&o.slices, "slices", 4, "alternating slices the duration is split into")
	fs.StringVar(&o.output, "output", "text", "text or json")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var err error
	if o.callers, err = positiveInts("--callers", callers); err != nil {
		fmt.Fprintln(stderr, "ulbench:", err)
		return 2
	}
	if o.keys < 1 || o.slices < 1 || o.duration <= 0 || (o.output != "text" && o.output != "json") {
		fmt.Fprintln(stderr, "ulbench: --keys and --slices must be at least 1, --duration positive, --output text or json")
		return 2
	}
	results, err := bench(ctx, o)
	if err != nil {
		fmt.Fprintln(stderr, "ulbench:", err)
		return 1
	}
	if o.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetEscapeHTML(false)
		err = enc.Encode(map[string]any{
			"cpus": runtime.NumCPU(), "keys": o.keys, "duration": o.duration.String(), "results": results,
		})
	} else {
		err = printText(stdout, results)
	}
	if err != nil {
		fmt.Fprintln(stderr, "ulbench:", err)
		return 1
	}
	return 0
}

func bench(ctx context.Context, o options) ([]result, error) {
	conn := o.dbURL
	if conn == "" {
		conn = os.Getenv("DATABASE_URL") // else the PG* variables
	}
	if err := prepareSchema(ctx, conn, o.schema); err != nil {
		return nil, err
	}
	rate := limiter.Rate{Period: time.Minute, Limit: 1 << 50}
	var out []result
	for _, c := range o.callers {
		pcfg, err := pgxpool.ParseConfig(conn)
		if err != nil {
			return nil, err
		}
		pcfg.ConnConfig.RuntimeParams["search_path"] = o.schema
		pool, err := openPool(ctx, pcfg, c)
		if err != nil {
			return nil, err
		}
		rdb := libredis.NewClient(&libredis.Options{Addr: o.redisAddr, DB: o.redisDB, PoolSize: c, MinIdleConns: c})
		redisStore, err := sredis.NewStoreWithOptions(rdb, limiter.StoreOptions{Prefix: "ulbench"})
		if err != nil {
			pool.Close()
			_ = rdb.Close()
			return nil, fmt.Errorf("redis at %s: %w", o.redisAddr, err)
		}
		pgStore, err := ulule.NewStoreWithOptions(pool, ulule.Options{Prefix: "ulbench"})
		if err != nil {
			return nil, err
		}
		stores := []struct {
			name string
			lim  *limiter.Limiter
			lat  []time.Duration
			busy time.Duration
		}{
			{name: "redis", lim: limiter.New(redisStore, rate)},
			{name: "pgrl", lim: limiter.New(pgStore, rate)},
		}
		slice := o.duration / time.Duration(o.slices)
		for range o.slices {
			for i := range stores {
				lat, err := load(ctx, stores[i].lim, c, o.keys, slice)
				if err != nil {
					pool.Close()
					_ = rdb.Close()
					return nil, fmt.Errorf("%s: %w", stores[i].name, err)
				}
				stores[i].lat = append(stores[i].lat, lat...)
				stores[i].busy += slice
			}
		}
		for _, s := range stores {
			slices.Sort(s.lat)
			out = append(out, result{
				Store: s.name, Callers: c, Ops: len(s.lat),
				OpsPerS: float64(len(s.lat)) / s.busy.Seconds(),
				P50us:   micros(s.lat, 0.50), P99us: micros(s.lat, 0.99),
			})
		}
		pool.Close()
		_ = rdb.Close()
	}
	return out, nil
}

// load runs callers goroutines calling lim.Get for d and returns every
// call's latency.
func load(ctx context.Context, lim *limiter.Limiter, callers, keys int, d time.Duration) ([]time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var (
		mu    sync.Mutex
		all   []time.Duration
		first error
		wg    sync.WaitGroup
	)
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, 4096)
			for ctx.Err() == nil {
				key := "key-" + strconv.Itoa(rand.IntN(keys))
				start := time.Now()
				_, err := lim.Get(context.WithoutCancel(ctx), key)
				if err != nil {
					mu.Lock()
					first = err
					mu.Unlock()
					cancel()
					return
				}
				lat = append(lat, time.Since(start))
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return all, first
}

func micros(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[int(q*float64(len(sorted)-1))].Nanoseconds()) / 1e3
}

// prepareSchema creates the schema and applies pgrl's migrations in it (as
// rl-migrate --schema does) when its table is missing.
func prepareSchema(ctx context.Context, conn, schemaName string) error {
	c, err := pgx.Connect(ctx, conn)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close(context.Background()) }()
	var exists bool
	if err := c.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schemaName, "pgrl_fixed_window"}.Sanitize()).Scan(&exists); err != nil {
		return err
	}
	if exists {
		return nil
	}
	m, err := migration.New(conn, migration.Config{Schema: schemaName})
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	_, err = m.Up(ctx)
	return err
}

// positiveInts parses a comma-separated flag value of positive integers;
// name is the flag, for the error message.
func positiveInts(name, s string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s: %q is not a positive integer", name, p)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: give at least one number", name)
	}
	return out, nil
}

// openPool opens a pool of exactly n connections with cfg and establishes
// all of them before it returns, so that the benchmark measures no
// connection setup.
func openPool(ctx context.Context, cfg *pgxpool.Config, n int) (*pgxpool.Pool, error) {
	cfg.MaxConns = int32(n)
	cfg.MinConns = int32(n)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	held := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			pool.Close()
			return nil, err
		}
		held = append(held, c)
	}
	return pool, nil
}

func printText(w io.Writer, results []result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "callers\tstore\tops/s\tp50 µs\tp99 µs\tpgrl/redis ops\t\n")
	for i, r := range results {
		ratio := ""
		if r.Store == "pgrl" && i > 0 && results[i-1].Callers == r.Callers {
			ratio = fmt.Sprintf("%.2f", r.OpsPerS/results[i-1].OpsPerS)
		}
		fmt.Fprintf(tw, "%d\t%s\t%.0f\t%.0f\t%.0f\t%s\t\n", r.Callers, r.Store, r.OpsPerS, r.P50us, r.P99us, ratio)
	}
	return tw.Flush()
}
