package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// options are the parsed command line.
type options struct {
	databaseURL string
	schema      string
	algorithms  []ratelimit.Algorithm
	callers     []int
	keys        []int
	duration    time.Duration
	warmup      time.Duration
	output      string
	cpuProfile  string
	coalescing  bool
	maxInFlight int
	spread      int
	policy      bool
	// policyOverrides is how many overrides (of other keys) the stored
	// policy has (--policy-overrides).
	policyOverrides int
	requestIDs      bool
	sqlCheck        bool
	// --concurrency and the hold it measures.
	concurrency bool
	holdSlots   []int
	holdKeys    int
	holdWindow  time.Duration
	holdFor     time.Duration
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("rl-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL connection URL; defaults to $DATABASE_URL, else the PG* environment variables")
	fs.StringVar(&o.schema, "schema", "pgrl_bench", "schema for the benchmark's tables; created and migrated")
	algorithms := fs.String("algorithms", "fixed_window,token_bucket,sliding_window", "comma-separated algorithms to measure")
	callers := fs.String("callers", "1,8", "comma-separated numbers of concurrent callers (the pool has as many connections)")
	keys := fs.String("keys", "100000,1", "comma-separated numbers of distinct keys the callers spread over (1: one hot key)")
	fs.DurationVar(&o.duration, "duration", 5*time.Second, "measured time per path (raw and library) per case")
	fs.DurationVar(&o.warmup, "warmup", time.Second, "unmeasured time per case before measuring, split between the paths")
	fs.StringVar(&o.output, "output", "text", "output format: text or json")
	fs.BoolVar(&o.coalescing, "coalescing", true, "leave the library's coalescing of concurrent checks on, as it is by default; false sets DatabaseOptions.DisableCoalescing")
	fs.IntVar(&o.maxInFlight, "max-in-flight", 0, "the library's DatabaseOptions.MaxInFlight (round trips before checks are coalesced); 0 keeps its default")
	fs.IntVar(&o.spread, "spread", 0, "the library's Config.Spread: split each key over this many rows (for a hot key); the raw path still updates one row, so the comparison shows what spreading buys")
	fs.BoolVar(&o.policy, "policy", false, "the library path reads its limit from a stored policy in each check's statement (Config.Policy, as package policy does); the raw path still sends the plain statement, so the ratio is the policy's cost; a third path sends the policy's statement directly, to split that cost between PostgreSQL and the library")
	fs.IntVar(&o.policyOverrides, "policy-overrides", 1000, "with --policy: how many overrides, all of other keys, the stored policy has; with none the library sends the statement that reads the policy's row alone, with some the one that also reads the key's override")
	fs.BoolVar(&o.sqlCheck, "sql-check", false, "the library path is the SQL function pgrl_check (a stored policy, called as any language would: SELECT allowed FROM pgrl_check(policy, key)) instead of the Go library; the raw path still sends the plain statement on the same rows, so the ratio is the function's cost")
	fs.BoolVar(&o.requestIDs, "request-ids", false, "every check of the library path carries a request id of its own (ratelimit.RequestID), and is a statement of its own that stores its answer; the raw path still sends the plain statement, so the ratio is the request id's cost; a third path sends that statement directly, to split that cost between PostgreSQL and the library")
	fs.BoolVar(&o.concurrency, "concurrency", false, "measure Limiter.Acquire and Slot.Release of a concurrency limit (Limit 1000000, so never refused; Window 30s) against Limiter.Allow of the fixed window, interleaved, instead of the algorithms; then hold --hold-slots slots for --hold-for and count the statements that extend them")
	holdSlots := fs.String("hold-slots", "1,100,1000", "with --concurrency: comma-separated numbers of slots held at once, each by a Database of its own")
	fs.IntVar(&o.holdKeys, "hold-keys", 100, "with --concurrency: the most keys the slots held spread over (min(slots, this))")
	fs.DurationVar(&o.holdWindow, "hold-window", 30*time.Second, "with --concurrency: the Window (lease) of the slots held; they are extended every third of it")
	fs.DurationVar(&o.holdFor, "hold-for", 65*time.Second, "with --concurrency: how long the slots are held; 0 skips the hold")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a Go CPU profile of the client (both paths) to this file, for go tool pprof")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: rl-bench [flags]\n\nMeasures pgrl's checks against the raw SQL statement they send, per algorithm,\nnumber of callers and key spread, and reports the HOT-update ratio of each table.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	for _, s := range cli.SplitList(*algorithms) {
		a, err := ratelimit.ParseAlgorithm(s)
		if err != nil {
			return o, fmt.Errorf("--algorithms: %v", err)
		}
		o.algorithms = append(o.algorithms, a)
	}
	var err error
	if o.callers, err = cli.PositiveInts("--callers", *callers); err != nil {
		return o, err
	}
	if o.keys, err = cli.PositiveInts("--keys", *keys); err != nil {
		return o, err
	}
	if o.holdSlots, err = cli.PositiveInts("--hold-slots", *holdSlots); err != nil {
		return o, err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	holdSet := set["hold-slots"] || set["hold-keys"] || set["hold-window"] || set["hold-for"]
	switch {
	case len(o.algorithms) == 0:
		return o, errors.New("--algorithms: name at least one algorithm")
	case o.duration <= 0:
		return o, fmt.Errorf("--duration %v: must be positive", o.duration)
	case o.warmup < 0:
		return o, fmt.Errorf("--warmup %v: must not be negative", o.warmup)
	case o.spread < 0:
		return o, fmt.Errorf("--spread %d: must not be negative", o.spread)
	case o.policyOverrides < 0 || o.policyOverrides > 1000000:
		return o, fmt.Errorf("--policy-overrides %d: must be from 0 to 1000000", o.policyOverrides)
	case set["policy-overrides"] && !o.policy:
		return o, errors.New("--policy-overrides goes with --policy; add it or drop --policy-overrides")
	case o.policy && o.spread > 1:
		return o, errors.New("--policy with --spread: a stored policy is read by single-row checks; drop one of them")
	case o.requestIDs && (o.policy || o.spread > 1):
		return o, errors.New("--request-ids with --policy or --spread: a check with a request id counts at the limiter's own figures on one row; drop one of them")
	case o.sqlCheck && (o.policy || o.requestIDs || o.spread > 1):
		return o, errors.New("--sql-check with --policy, --request-ids or --spread: pgrl_check reads its policy itself, on one row per key; drop one of them")
	case o.concurrency && (o.policy || o.requestIDs || o.sqlCheck || o.spread > 1):
		return o, errors.New("--concurrency with --policy, --request-ids, --sql-check or --spread: it compares an acquire with the plain fixed-window check; drop one of them")
	case o.concurrency && set["algorithms"] && !slices.Equal(o.algorithms, []ratelimit.Algorithm{ratelimit.FixedWindow}):
		return o, errors.New("--concurrency with --algorithms: an acquire is compared with the fixed-window check only; drop --algorithms")
	case holdSet && !o.concurrency:
		return o, errors.New("--hold-slots, --hold-keys, --hold-window and --hold-for go with --concurrency; add it or drop them")
	case len(o.holdSlots) == 0:
		return o, errors.New("--hold-slots: name at least one number of slots")
	case o.holdKeys < 1:
		return o, fmt.Errorf("--hold-keys %d: must be positive", o.holdKeys)
	case o.holdWindow < ratelimit.MinSlotLease:
		return o, fmt.Errorf("--hold-window %v: must be at least %v", o.holdWindow, ratelimit.MinSlotLease)
	case o.holdFor < 0:
		return o, fmt.Errorf("--hold-for %v: must not be negative", o.holdFor)
	case o.maxInFlight < 0:
		return o, fmt.Errorf("--max-in-flight %d: must not be negative", o.maxInFlight)
	case o.schema == "":
		return o, errors.New("--schema: must not be empty")
	case o.output != "text" && o.output != "json":
		return o, fmt.Errorf("--output %q: use text or json", o.output)
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
		fmt.Fprintf(stderr, "rl-bench: %v\n", err)
		return cli.ExitUsage
	}
	if o.cpuProfile != "" {
		stop, err := loadtest.StartCPUProfile(o.cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "rl-bench: %v\n", err)
			return cli.ExitError
		}
		defer stop()
	}
	conn, source := cli.ConnString(o.databaseURL)
	fmt.Fprintf(stderr, "rl-bench: connection from %s, schema %s\n", source, o.schema)
	rep, err := benchmark(ctx, o, conn, stderr)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("interrupted: %w", ctx.Err())
		}
		fmt.Fprintf(stderr, "rl-bench: %s\n", cli.Explain(err))
		return cli.ExitError
	}
	if o.output == "json" {
		err = cli.PrintJSON(stdout, rep)
	} else {
		err = printText(stdout, rep)
	}
	if err != nil {
		fmt.Fprintf(stderr, "rl-bench: %v\n", err)
		return cli.ExitError
	}
	return cli.ExitOK
}
