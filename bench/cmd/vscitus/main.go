// Command vscitus measures what distributing pgrl's counter tables over a
// Citus cluster costs a check: the same statement (the one package ratelimit
// sends for a single check) on a distributed table and on an ordinary table
// of the coordinator, in alternating slices of one run, so that noise from
// other work on the machine falls on both alike.
//
// It migrates two schemas on the coordinator named by --database-url:
// --schema with "_dist" appended, whose counter tables rl-migrate
// distributes, and "_local", whose tables it then turns back into ordinary
// tables of the coordinator (undistribute_table) and whose step functions it
// lets the planner inline again, as on one PostgreSQL. For each algorithm and
// number of callers it reports checks/s and p50 of both, and the ratios
// distributed / local.
//
//	vscitus --database-url "$(bash scripts/citus.sh url)" --callers 1,8 --duration 3s
//
// Drop the schemas when done. Exit status: 0 when the benchmark ran, 1 on a
// runtime error, 2 on bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/ratelimit"
)

func main() { cli.Main(run) }

const (
	benchLimit  = 1_000_000_000 // every check is admitted
	benchWindow = time.Hour
)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("vscitus", flag.ContinueOnError)
	fs.SetOutput(stderr)
	url := fs.String("database-url", "", "the Citus coordinator's database (required)")
	schema := fs.String("schema", "pgrl_vscitus", "prefix of the two schemas, created and migrated")
	callersFlag := fs.String("callers", "1,8", "comma-separated numbers of concurrent callers")
	keys := fs.Int("keys", 100000, "number of distinct keys the callers spread over")
	algs := fs.String("algorithms", "fixed_window,token_bucket,sliding_window", "comma-separated algorithms")
	duration := fs.Duration("duration", 3*time.Second, "measured time per path per case")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var callers []int
	for _, s := range cli.SplitList(*callersFlag) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			fmt.Fprintf(stderr, "vscitus: --callers %q: give numbers of 1 or more, such as 1,8\n", *callersFlag)
			return 2
		}
		callers = append(callers, n)
	}
	if *url == "" || *keys < 1 || *duration <= 0 || len(callers) == 0 {
		fmt.Fprintln(stderr, "vscitus: give --database-url (a Citus coordinator), --keys of 1 or more and a positive --duration")
		return 2
	}
	if err := bench(ctx, *url, *schema, cli.SplitList(*algs), callers, *keys, *duration, stdout); err != nil {
		fmt.Fprintf(stderr, "vscitus: %v\n", err)
		return 1
	}
	return 0
}

func bench(ctx context.Context, url, schema string, algs []string, callers []int, nkeys int, d time.Duration, out io.Writer) error {
	cfg, err := cli.ParseConfig(url, "vscitus")
	if err != nil {
		return err
	}
	dist, local := schema+"_dist", schema+"_local"
	for _, s := range []string{dist, local} {
		m, err := migration.NewWithConnConfig(cfg, migration.Config{Schema: s})
		if err != nil {
			return err
		}
		_, err = m.Up(ctx)
		_ = m.Close()
		if err != nil {
			return fmt.Errorf("migrate %s: %w", s, err)
		}
	}
	conn, err := cli.Connect(ctx, cfg, nil)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	if ok, err := migration.HasCitus(ctx, conn); err != nil || !ok {
		return errors.Join(err, errors.New("the database has no citus extension: point --database-url at a Citus coordinator"))
	}
	for _, t := range migration.DistributedTables {
		name := pgx.Identifier{local, t}.Sanitize()
		if _, err := conn.Exec(ctx, `SELECT undistribute_table($1::regclass)
			 WHERE EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = $1::regclass)`, name); err != nil {
			return fmt.Errorf("keep %s local: %w", name, err)
		}
	}
	// rl-migrate pins the step functions on Citus, which stops the planner
	// inlining them; on the local schema they are inlined again, as on one
	// PostgreSQL, so that the local figures are what a plain table gets.
	var steps []string
	if err := conn.QueryRow(ctx, `SELECT coalesce(array_agg(p.oid::regprocedure::text), '{}')
		  FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
		 WHERE n.nspname = $1 AND p.proname = ANY ($2)`, local, migration.StepFunctions).Scan(&steps); err != nil {
		return err
	}
	for _, f := range steps {
		if _, err := conn.Exec(ctx, "ALTER FUNCTION "+f+" RESET ALL"); err != nil {
			return fmt.Errorf("inline %s again: %w", f, err)
		}
	}

	fmt.Fprintf(out, "%15s %8s %8s %11s %11s %6s %12s %12s %6s\n",
		"algorithm", "callers", "keys", "local/s", "dist/s", "ratio", "local p50µs", "dist p50µs", "ratio")
	for _, a := range algs {
		for _, n := range callers {
			lp, dp, err := runCase(ctx, url, local, dist, ratelimit.Algorithm(a), n, nkeys, d)
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "%15s %8d %8d %11.0f %11.0f %6.3f %12.1f %12.1f %6.3f\n", a, n, nkeys,
				lp.OpsPerSec(), dp.OpsPerSec(), loadtest.Ratio(dp.OpsPerSec(), lp.OpsPerSec()),
				lp.PercentileUs(0.5), dp.PercentileUs(0.5), loadtest.Ratio(dp.PercentileUs(0.5), lp.PercentileUs(0.5)))
		}
	}
	return nil
}

// runCase measures one algorithm at n callers on both schemas.
func runCase(ctx context.Context, url, local, dist string, a ratelimit.Algorithm, n, nkeys int, d time.Duration) (lp, dp *loadtest.Path, err error) {
	keys := make([][]byte, nkeys)
	for i := range keys {
		keys[i] = ratelimit.StoredKey(ratelimit.HashedKeys, "vscitus", "key-"+strconv.Itoa(i))
	}
	var paths []*loadtest.Path
	for _, s := range []string{local, dist} {
		pc, err := pgxpool.ParseConfig(url)
		if err != nil {
			return nil, nil, err
		}
		pc.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{s}.Sanitize()
		pool, err := cli.OpenPool(ctx, pc, n)
		if err != nil {
			return nil, nil, err
		}
		defer pool.Close()
		paths = append(paths, &loadtest.Path{Name: s, Check: check(pool, a, keys)})
	}
	plan := loadtest.Plan{Callers: n, Keys: nkeys, Warmup: time.Second, Duration: d, Slice: 100 * time.Millisecond}
	if err := loadtest.Run(ctx, plan, paths...); err != nil {
		return nil, nil, err
	}
	return paths[0], paths[1], nil
}

// check returns the single check's statement of algorithm a, as
// ratelimit.Limiter sends it, on db.
func check(db gen.DBTX, a ratelimit.Algorithm, keys [][]byte) loadtest.Check {
	q := gen.New()
	windowUs := benchWindow.Microseconds()
	switch a {
	case ratelimit.TokenBucket:
		return func(ctx context.Context, k int) error {
			_, err := q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
				Key: keys[k], Cost: 1, Capacity: benchLimit, RefillPerUs: float64(benchLimit) / float64(windowUs),
			})
			return err
		}
	case ratelimit.SlidingWindow:
		return func(ctx context.Context, k int) error {
			_, err := q.SlidingWindowTake(ctx, db, gen.SlidingWindowTakeParams{
				Key: keys[k], WindowUs: windowUs, Cost: 1, MaxCount: benchLimit,
			})
			return err
		}
	default:
		return func(ctx context.Context, k int) error {
			_, err := q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
				Key: keys[k], Cost: 1, MaxCount: benchLimit, WindowUs: windowUs,
			})
			return err
		}
	}
}
