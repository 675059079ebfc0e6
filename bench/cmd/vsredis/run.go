package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// options are the parsed command line.
type options struct {
	databaseURL       string
	schema            string
	redisAddr         string
	redisDB           int
	callers           []int
	keys              []int
	mix               string // "" for none
	mixRequests       int
	duration          time.Duration
	warmup            time.Duration
	pgConns           int
	maxBatch          int
	maxInFlight       int
	compareCoalescing bool
	variants          []variant
	output            string
	cpuProfile        string
	// algorithm is pgrl's algorithm in the key-space cases and the mix.
	algorithm ratelimit.Algorithm
	// leaseSize is lease.Options.Size for the leased path; 0: off.
	leaseSize int64
	// leaseShare and leaseIdle are lease.Options.Share and Idle.
	leaseShare int
	leaseIdle  time.Duration
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("vsredis", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL connection URL; defaults to $DATABASE_URL, else $"+dbtest.EnvURL+", else "+dbtest.DefaultURL)
	fs.StringVar(&o.schema, "schema", "pgrl_redisbench", "schema for pgrl's tables; created and migrated")
	fs.StringVar(&o.redisAddr, "redis-addr", "127.0.0.1:6379", "Redis address (host:port)")
	fs.IntVar(&o.redisDB, "redis-db", 0, "Redis database number")
	callers := fs.String("callers", "1,8,32,64", "comma-separated numbers of concurrent callers")
	keys := fs.String("keys", "100000,10,1", "comma-separated numbers of distinct keys the callers draw from (10: a few hot keys, 1: one hot key), or none")
	fs.StringVar(&o.mix, "mix", mixApp, "application mix to run at every number of callers besides the key spaces: "+mixApp+" (the example application's nine limits and endpoints), or none")
	fs.IntVar(&o.mixRequests, "mix-requests", mixRequests, "requests drawn for the mix before the run, which the callers pick among (their distinct keys are touched first)")
	fs.DurationVar(&o.duration, "duration", 5*time.Second, "measured time per path per case")
	fs.DurationVar(&o.warmup, "warmup", time.Second, "unmeasured time per case before measuring, split between the paths")
	fs.IntVar(&o.pgConns, "pg-conns", 0, "pgx pool size (MaxConns); 0 means min(callers, 16)")
	fs.IntVar(&o.maxBatch, "max-batch", 0, "ratelimit.DatabaseOptions.MaxBatch; 0 keeps the library's default")
	fs.IntVar(&o.maxInFlight, "max-in-flight", 0, "ratelimit.DatabaseOptions.MaxInFlight; 0 keeps the library's default")
	fs.BoolVar(&o.compareCoalescing, "compare-coalescing", false, "also measure pgrl with DisableCoalescing in every case")
	fs.Func("variant", "also measure pgrl with other settings, as in-flight=N,batch=N,conns=N,coalescing=off (repeatable): each variant adds a path to every case; conns gives it a pool of its own", func(s string) error {
		v, err := parseVariant(s)
		if err == nil {
			o.variants = append(o.variants, v)
		}
		return err
	})
	fs.StringVar(&o.output, "output", "text", "output format: text or json")
	algorithm := fs.String("algorithm", string(ratelimit.TokenBucket), "pgrl's algorithm in the key-space cases and the mix: token_bucket (the closest to redis_rate's GCRA), or fixed_window or sliding_window with each limit's burst as the limit per window (rate period; 1s for the key spaces)")
	fs.Int64Var(&o.leaseSize, "lease-size", 0, "lease pgrl's limiters in the key-space cases and the mix with package lease, in slices of at most this many units (lease.Options.Size, or the limit when that is smaller); 0: off.")
	fs.IntVar(&o.leaseShare, "lease-share", 1, "lease.Options.Share of the leased path: each slice is ceil(left/share) of what a key has left, at most --lease-size. 1 (the default) suits the benchmark's one process; a deployment sets it near its number of processes")
	fs.DurationVar(&o.leaseIdle, "lease-idle", time.Minute, "lease.Options.Idle of the leased path: a key's unused units are returned after this long without a check (one statement each)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a Go CPU profile of the whole run to this file, for go tool pprof")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: vsredis [flags]\n\nCompares pgrl's limiter on PostgreSQL with go-redis/redis_rate on Redis:\nops/s, p50 and p99 per number of callers and key space, and requests/s\nand checks/s of an application's mix of limits.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var err error
	if o.callers, err = cli.PositiveInts("--callers", *callers); err != nil {
		return o, err
	}
	if *keys != "none" {
		if o.keys, err = cli.PositiveInts("--keys", *keys); err != nil {
			return o, err
		}
	}
	switch o.mix {
	case mixApp:
	case "none":
		o.mix = ""
	default:
		return o, fmt.Errorf("--mix %q: use %s or none", o.mix, mixApp)
	}
	o.algorithm = ratelimit.Algorithm(*algorithm)
	switch o.algorithm {
	case ratelimit.TokenBucket, ratelimit.FixedWindow, ratelimit.SlidingWindow:
	default:
		return o, fmt.Errorf("--algorithm %q: use token_bucket, fixed_window or sliding_window", *algorithm)
	}
	switch {
	case o.leaseShare < 1:
		return o, fmt.Errorf("--lease-share %d: at least 1", o.leaseShare)
	case o.leaseIdle < time.Millisecond:
		return o, fmt.Errorf("--lease-idle %v: at least 1ms", o.leaseIdle)
	case o.leaseSize < 0:
		return o, fmt.Errorf("--lease-size %d: must not be negative (0 turns leases off)", o.leaseSize)
	}
	if len(o.keys) == 0 && o.mix == "" {
		return o, errors.New("--keys none and --mix none: nothing to run; give a key space or a mix")
	}
	switch {
	case o.duration <= 0:
		return o, fmt.Errorf("--duration %v: must be positive", o.duration)
	case o.warmup < 0:
		return o, fmt.Errorf("--warmup %v: must not be negative", o.warmup)
	case o.schema == "":
		return o, errors.New("--schema: must not be empty")
	case o.mixRequests < 1:
		return o, fmt.Errorf("--mix-requests %d: must be positive", o.mixRequests)
	case o.pgConns < 0, o.maxBatch < 0, o.maxInFlight < 0:
		return o, errors.New("--pg-conns, --max-batch and --max-in-flight must not be negative")
	case o.output != "text" && o.output != "json":
		return o, fmt.Errorf("--output %q: use text or json", o.output)
	}
	if o.databaseURL == "" {
		o.databaseURL = os.Getenv("DATABASE_URL")
	}
	if o.databaseURL == "" {
		o.databaseURL = dbtest.URL()
	}
	return o, nil
}

// run is the whole program; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return cli.ExitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "vsredis: %v\n", err)
		return cli.ExitUsage
	}
	if o.cpuProfile != "" {
		stop, err := loadtest.StartCPUProfile(o.cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "vsredis: %v\n", err)
			return cli.ExitError
		}
		defer stop()
	}
	rep, err := benchmark(ctx, o, stderr)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("interrupted: %w", ctx.Err())
		}
		fmt.Fprintf(stderr, "vsredis: %v\n", err)
		return cli.ExitError
	}
	if o.output == "json" {
		err = printJSON(stdout, rep)
	} else {
		err = printText(stdout, rep)
	}
	if err != nil {
		fmt.Fprintf(stderr, "vsredis: %v\n", err)
		return cli.ExitError
	}
	return cli.ExitOK
}

// variant is pgrl with other coalescing settings, measured as an extra path.
type variant struct {
	name        string
	maxInFlight int
	maxBatch    int
	conns       int  // its own pool of this size; 0 shares the case's pool
	off         bool // DisableCoalescing
}

// parseVariant reads "in-flight=N,batch=N,conns=N,coalescing=off" (any of
// them).
func parseVariant(s string) (variant, error) {
	v := variant{name: "pgrl_" + strings.NewReplacer("=", "", ",", "_", "-", "").Replace(s)}
	for _, kv := range strings.Split(s, ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if k == "coalescing" && (val == "off" || val == "on") {
			v.off = val == "off"
			continue
		}
		n, err := strconv.Atoi(val)
		if !ok || err != nil || n < 1 {
			return v, fmt.Errorf("%q: want in-flight=N,batch=N,conns=N with positive N, or coalescing=off", s)
		}
		switch k {
		case "in-flight":
			v.maxInFlight = n
		case "batch":
			v.maxBatch = n
		case "conns":
			v.conns = n
		default:
			return v, fmt.Errorf("%q: unknown setting %q; use in-flight, batch, conns or coalescing", s, k)
		}
	}
	return v, nil
}
