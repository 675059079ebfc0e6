// Command rl-cleanup removes pgrl counter rows that can no longer change any
// decision. It is meant for cron: bounded in time, safe when two runs
// overlap (the second exits 0 and does nothing), and stoppable with SIGINT or
// SIGTERM between batches.
//
// Usage:
//
//	rl-cleanup [flags]
//
// Run `rl-cleanup --help` for the flags; docs/CLEANUP.md has the details.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/ident"
	"github.com/pgrl/pgrl/internal/notmigrated"
)

func main() { cli.Main(run) }

const usageText = `Usage: rl-cleanup [flags]

Removes pgrl counter rows that can no longer change any decision: expired
fixed windows, token buckets full again, sliding-window state older than two
windows, the rows of concurrency limits whose every slot has lapsed. Delete
mode (the default) deletes them in bounded batches; partition mode (--mode
partitions, for the partitioned layout) drops past partitions of
pgrl_fixed_window whole and creates upcoming ones.

Two overlapping runs never both work: the second prints
"another rl-cleanup is running; nothing done" and exits 0.
SIGINT or SIGTERM stops the run between batches and prints a summary.

Connection: --database-url, else $DATABASE_URL, else the PG* variables.

Exit codes: 0 success or nothing to do, 1 runtime error, 2 usage error.

Flags:
`

// config is the parsed command line.
type config struct {
	databaseURL string
	schema      string
	output      string
	opts        cleanup.Options
	progress    time.Duration
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	out := &output{stdout: stdout, stderr: stderr, json: wantsJSON(args)}
	cfg, err := parseFlags(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stderr, usageText)
		_, fs := defineFlags(&config{})
		fs.SetOutput(stderr)
		fs.PrintDefaults()
		return cli.ExitOK
	}
	if err != nil {
		return out.fail(cli.ExitUsage, err.Error()+"; run `rl-cleanup --help` for usage", nil)
	}

	connString, _ := cli.ConnString(cfg.databaseURL)
	pcfg, err := cli.ParseConfig(connString, "rl-cleanup")
	if err != nil {
		return out.fail(cli.ExitUsage, err.Error(), nil)
	}
	settings := map[string]string{
		"lock_timeout":      fmt.Sprint(cfg.opts.LockTimeout.Milliseconds()),
		"statement_timeout": fmt.Sprint(cfg.opts.StatementTimeout.Milliseconds()),
	}
	if cfg.schema != "" {
		settings["search_path"] = pgx.Identifier{cfg.schema}.Sanitize()
	}
	noURL := notmigrated.DefaultsOnly(connString)
	conn, err := cli.Connect(ctx, pcfg, settings)
	if err != nil {
		msg := err.Error()
		if noURL {
			msg += "; " + noURLHint
		}
		return out.fail(cli.ExitError, msg, nil)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()

	cfg.opts.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	prog := newProgress(stderr, isTerminal(stderr), cfg.progress)
	cfg.opts.Progress = prog.report

	res, err := cleanup.RunConn(ctx, conn, cfg.opts)
	prog.finish()
	if err != nil {
		code := cli.ExitError
		msg := cli.Explain(err)
		switch {
		case errors.Is(err, cleanup.ErrPlainLayout), errors.Is(err, cleanup.ErrInvalidOptions):
			code = cli.ExitUsage
			msg = err.Error()
		case errors.Is(err, cleanup.ErrNotMigrated):
			var nm *notmigrated.Error
			if errors.As(err, &nm) {
				nm.NoURL = noURL
			}
			msg = err.Error()
		case errors.Is(err, cleanup.ErrPermission):
			msg = err.Error()
		case errors.Is(err, context.Canceled):
			msg = "interrupted before any work was done; nothing changed"
		}
		if res.Batches == 0 && (res.Partitions == nil || len(res.Partitions.Dropped) == 0) {
			return out.fail(code, msg, nil)
		}
		// Part of the work was done: say what, with the error.
		return out.fail(code, msg, &res)
	}
	if out.json {
		if perr := cli.PrintJSON(stdout, res); perr != nil {
			fmt.Fprintln(stderr, "rl-cleanup:", perr)
			return cli.ExitError
		}
	} else {
		printText(stdout, res)
	}
	return cli.ExitOK
}

// noURLHint ends an error on a connection made with libpq's defaults alone,
// the usual state of a cron job that sets no DATABASE_URL.
const noURLHint = "no database URL is configured (neither --database-url nor DATABASE_URL is set, nor any PG* variable): " +
	"pass --database-url or set DATABASE_URL (in a crontab, a DATABASE_URL=... line above the job)"

// output writes results and errors in the chosen format.
type output struct {
	stdout, stderr io.Writer
	json           bool
}

// failure is the JSON object printed on an error: the error and the exit
// code, and, when part of the work was done before it, the result so far.
type failure struct {
	*cleanup.Result
	Error    string `json:"error"`
	ExitCode int    `json:"exit_code"`
}

// fail reports an error as one line on stderr, or, with --output json, as
// one JSON object on stdout; res, when not nil, is the work done before it.
// It returns code.
func (o *output) fail(code int, msg string, res *cleanup.Result) int {
	if o.json {
		_ = cli.PrintJSON(o.stdout, failure{Result: res, Error: msg, ExitCode: code})
		return code
	}
	if res != nil {
		printText(o.stdout, *res)
	}
	fmt.Fprintln(o.stderr, "rl-cleanup: "+msg)
	return code
}

// wantsJSON reports whether the command line asks for JSON output, looked
// up before parsing so that errors in any flag are reported as JSON too.
func wantsJSON(args []string) bool {
	json := false
	for i, arg := range args {
		if arg == "--" {
			break
		}
		switch {
		case arg == "--output=json" || arg == "-output=json":
			json = true
		case (arg == "--output" || arg == "-output") && i+1 < len(args):
			json = args[i+1] == "json"
		case strings.HasPrefix(arg, "--output=") || strings.HasPrefix(arg, "-output="):
			json = false
		}
	}
	return json
}

// Largest values the duration flags accept: PostgreSQL's lock_timeout and
// statement_timeout hold at most 2147483647 ms (about 24 days).
const (
	maxTimeout  = 2147483647 * time.Millisecond
	maxHorizon  = 366 * 24 * time.Hour
	maxPause    = time.Hour
	maxDuration = 7 * 24 * time.Hour
)

// flags holds the raw flag values before validation.
type flags struct {
	mode        string
	partitions  bool
	batchSize   int
	maxDuration time.Duration
	horizon     time.Duration
	lockTimeout time.Duration
	stmtTimeout time.Duration
	batchPause  time.Duration
	maxGrace    time.Duration
}

// defineFlags defines rl-cleanup's flags on a set that prints nothing:
// run reports errors as one line.
func defineFlags(cfg *config) (*flags, *flag.FlagSet) {
	f := &flags{}
	fs := flag.NewFlagSet("rl-cleanup", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&cfg.databaseURL, "database-url", "", "PostgreSQL connection URL (default $DATABASE_URL, else the PG* variables)")
	fs.StringVar(&cfg.schema, "schema", "", "schema holding pgrl's tables (default: the connection's search_path)")
	fs.StringVar(&f.mode, "mode", "delete", "delete: delete dead rows in batches; partitions: drop past partitions and create upcoming ones (partitioned layout only)")
	fs.BoolVar(&f.partitions, "partitions", false, "same as --mode partitions")
	fs.IntVar(&f.batchSize, "batch-size", cleanup.DefaultBatchSize, "rows deleted per statement (1 to 1000000)")
	fs.DurationVar(&f.maxDuration, "max-duration", 0, "stop between batches after this long, e.g. 2m (default: until done; at most 168h)")
	fs.DurationVar(&f.horizon, "horizon", cleanup.DefaultHorizon, "how far ahead partition mode creates partitions (at most 8784h; unused in delete mode)")
	fs.DurationVar(&f.lockTimeout, "lock-timeout", cleanup.DefaultLockTimeout, "longest wait for any lock (the session's lock_timeout; 1ms to 596h)")
	fs.DurationVar(&f.stmtTimeout, "statement-timeout", cleanup.DefaultStatementTimeout, "longest any one statement may run (the session's statement_timeout; 1ms to 596h)")
	fs.DurationVar(&f.batchPause, "batch-pause", 0, "sleep between batches, to leave more of the server to checks (at most 1h)")
	fs.DurationVar(&f.maxGrace, "max-grace", cleanup.DefaultMaxGrace, "longest an open transaction holds the cutoff back: rows it can still read are kept this long at most")
	fs.BoolVar(&cfg.opts.DryRun, "dry-run", false, "count what would be deleted, dropped and created; change nothing")
	fs.BoolVar(&cfg.opts.Vacuum, "vacuum", false, "VACUUM each table rows were deleted from (autovacuum does this otherwise)")
	fs.StringVar(&cfg.output, "output", "text", "text or json (one JSON object on stdout, also for errors)")
	fs.DurationVar(&cfg.progress, "progress-every", 5*time.Second, "how often long runs report progress on stderr")
	return f, fs
}

// parseError rewrites the flag package's error for a value that does not
// parse into a line that names the fix.
func parseError(fs *flag.FlagSet, err error) error {
	msg := strings.Replace(err.Error(), " -", " --", 1)
	var name string
	if _, rest, ok := strings.Cut(err.Error(), " for flag -"); ok {
		name, _, _ = strings.Cut(rest, ":")
	}
	fl := fs.Lookup(name)
	if fl == nil {
		return errors.New(msg)
	}
	switch fl.Value.(flag.Getter).Get().(type) {
	case time.Duration:
		return fmt.Errorf("--%s: not a duration (%s); use a number with a unit, such as 500ms, 30s, 5m or 24h", name, strings.TrimPrefix(msg, "invalid value "))
	case int:
		return fmt.Errorf("--%s: not a whole number in range (%s); use a number such as %s", name, strings.TrimPrefix(msg, "invalid value "), fl.DefValue)
	}
	return errors.New(msg)
}

// parseFlags parses and validates the command line. It returns
// flag.ErrHelp for --help, and otherwise an error of one line that names
// the fix.
func parseFlags(args []string) (config, error) {
	var cfg config
	f, fs := defineFlags(&cfg)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cfg, err
		}
		return cfg, parseError(fs, err)
	}
	usage := func(format string, a ...any) (config, error) {
		return cfg, fmt.Errorf(format, a...)
	}
	if fs.NArg() > 0 {
		return usage("unexpected argument %q; rl-cleanup takes only flags", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })

	m, err := cleanup.ParseMode(f.mode)
	if err != nil {
		return usage("--mode %q is not a mode; use --mode delete or --mode partitions", f.mode)
	}
	if f.partitions {
		if set["mode"] && m != cleanup.ModePartitions {
			return usage("--partitions contradicts --mode %s; pass one of them", f.mode)
		}
		m = cleanup.ModePartitions
	}
	within := func(name string, v, lo, hi time.Duration, example string) error {
		if v < lo || v > hi {
			return fmt.Errorf("--%s %s is out of range; use a duration from %s to %s, such as %s", name, v, lo, hi, example)
		}
		return nil
	}
	switch {
	case set["database-url"] && strings.TrimSpace(cfg.databaseURL) == "":
		return usage("--database-url is empty; pass a URL such as postgres://user@host/db, or omit the flag to use $DATABASE_URL")
	case set["schema"] && strings.TrimSpace(cfg.schema) == "":
		return usage("--schema is empty; name the schema holding pgrl's tables, or omit the flag")
	case f.batchSize <= 0 || f.batchSize > 1_000_000:
		return usage("--batch-size %d is out of range; use a number from 1 to 1000000, such as %d", f.batchSize, cleanup.DefaultBatchSize)
	case set["max-duration"] && f.maxDuration <= 0:
		return usage("--max-duration %s must be positive, such as 2m (omit it to run until done)", f.maxDuration)
	case f.horizon <= 0:
		return usage("--horizon %s must be positive, such as 24h", f.horizon)
	case f.lockTimeout < time.Millisecond:
		return usage("--lock-timeout %s must be at least 1ms, such as 1s", f.lockTimeout)
	case f.stmtTimeout < time.Millisecond:
		return usage("--statement-timeout %s must be at least 1ms, such as 30s", f.stmtTimeout)
	case f.batchPause < 0:
		return usage("--batch-pause %s must not be negative; use 0 for no pause, or a pause such as 10ms", f.batchPause)
	case f.maxGrace <= 0:
		return usage("--max-grace %s must be positive, such as 15m", f.maxGrace)
	case cfg.progress <= 0:
		return usage("--progress-every %s must be positive, such as 5s", cfg.progress)
	}
	for _, e := range []error{
		within("max-duration", f.maxDuration, 0, maxDuration, "2m"),
		within("horizon", f.horizon, time.Nanosecond, maxHorizon, "24h"),
		within("lock-timeout", f.lockTimeout, time.Millisecond, maxTimeout, "1s"),
		within("statement-timeout", f.stmtTimeout, time.Millisecond, maxTimeout, "30s"),
		within("batch-pause", f.batchPause, 0, maxPause, "10ms"),
	} {
		if e != nil {
			return cfg, e
		}
	}
	switch cfg.output {
	case "text", "json":
	default:
		return usage("--output %q is not a format; use --output text or --output json", cfg.output)
	}
	if set["schema"] {
		if err := ident.Check("--schema", cfg.schema); err != nil {
			return usage("%v", err)
		}
	}
	cfg.opts.Mode = m
	cfg.opts.BatchSize = f.batchSize
	cfg.opts.MaxDuration = f.maxDuration
	cfg.opts.Horizon = f.horizon
	cfg.opts.LockTimeout = f.lockTimeout
	cfg.opts.StatementTimeout = f.stmtTimeout
	cfg.opts.BatchPause = f.batchPause
	cfg.opts.MaxGrace = f.maxGrace
	return cfg, nil
}

func printText(w io.Writer, res cleanup.Result) {
	if res.Skipped {
		fmt.Fprintln(w, res.SkippedReason)
		return
	}
	verb := "deleted"
	if res.DryRun {
		verb = "would delete"
	}
	if p := res.Partitions; p != nil {
		pv, cv := "dropped", "created"
		if res.DryRun {
			pv, cv = "would drop", "would create"
		}
		fmt.Fprintf(w, "pgrl_fixed_window: %s %d partitions (%d rows), %s %d partitions ahead\n",
			pv, len(p.Dropped), p.RowsDropped, cv, p.Created)
		if len(p.LeftoversDropped) > 0 {
			fmt.Fprintf(w, "pgrl_fixed_window: %s %d tables left detached by an interrupted run\n", pv, len(p.LeftoversDropped))
		}
	} else {
		printTable(w, cleanup.TableFixedWindow, verb, res.DryRun, res.Tables.FixedWindow)
	}
	printTable(w, cleanup.TableTokenBucket, verb, res.DryRun, res.Tables.TokenBucket)
	printTable(w, cleanup.TableSlidingWindow, verb, res.DryRun, res.Tables.SlidingWindow)
	printTable(w, cleanup.TableConcurrency, verb, res.DryRun, res.Tables.Concurrency)
	line := fmt.Sprintf("done in %s", res.Duration.Round(time.Millisecond))
	if res.StoppedEarly {
		line = fmt.Sprintf("stopped early (%s) after %s; run again to continue", res.StopReason, res.Duration.Round(time.Millisecond))
	}
	fmt.Fprintln(w, line)
}

func printTable(w io.Writer, name, verb string, dry bool, t cleanup.TableResult) {
	if dry {
		fmt.Fprintf(w, "%s: %s %d rows\n", name, verb, t.WouldDelete)
		return
	}
	fmt.Fprintf(w, "%s: %s %d rows in %d batches\n", name, verb, t.Deleted, t.Batches)
}
