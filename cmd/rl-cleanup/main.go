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
)

func main() { cli.Main(run) }

const usageText = `Usage: rl-cleanup [flags]

Removes pgrl counter rows that can no longer change any decision: expired
fixed windows, token buckets full again, sliding-window state older than two
windows. Delete mode (the default) deletes them in bounded batches; partition
mode (--mode partitions, for the partitioned layout) drops past partitions of
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
	cfg, code, ok := parseFlags(args, stderr)
	if !ok {
		return code
	}

	connString, _ := cli.ConnString(cfg.databaseURL)
	pcfg, err := cli.ParseConfig(connString, "rl-cleanup")
	if err != nil {
		fmt.Fprintln(stderr, "rl-cleanup:", err)
		return cli.ExitUsage
	}
	settings := map[string]string{
		"lock_timeout":      fmt.Sprint(cfg.opts.LockTimeout.Milliseconds()),
		"statement_timeout": fmt.Sprint(cfg.opts.StatementTimeout.Milliseconds()),
	}
	if cfg.schema != "" {
		settings["search_path"] = pgx.Identifier{cfg.schema}.Sanitize()
	}
	conn, err := cli.Connect(ctx, pcfg, settings)
	if err != nil {
		fmt.Fprintln(stderr, "rl-cleanup:", err)
		return cli.ExitError
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()

	cfg.opts.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var lastReport time.Time
	cfg.opts.Progress = func(p cleanup.Progress) {
		if time.Since(lastReport) < cfg.progress {
			return
		}
		lastReport = time.Now()
		if p.PartitionsDropped > 0 && p.Table == cleanup.TableFixedWindow {
			fmt.Fprintf(stderr, "rl-cleanup: %s: %d partitions dropped (%s)\n", p.Table, p.PartitionsDropped, p.Elapsed.Round(time.Millisecond))
			return
		}
		fmt.Fprintf(stderr, "rl-cleanup: %s: %d rows deleted in %d batches (%s)\n", p.Table, p.Deleted, p.Batches, p.Elapsed.Round(time.Millisecond))
	}
	lastReport = time.Now()

	res, err := cleanup.RunConn(ctx, conn, cfg.opts)
	if err != nil {
		code := cli.ExitError
		msg := cli.Explain(err)
		switch {
		case errors.Is(err, cleanup.ErrPlainLayout), errors.Is(err, cleanup.ErrInvalidOptions):
			code = cli.ExitUsage
			msg = err.Error()
		case errors.Is(err, cleanup.ErrNotMigrated):
			msg = err.Error()
		}
		fmt.Fprintln(stderr, "rl-cleanup:", msg)
		if res.Batches == 0 && (res.Partitions == nil || len(res.Partitions.Dropped) == 0) {
			return code
		}
		// Part of the work was done: say what.
	}
	if cfg.output == "json" {
		if perr := cli.PrintJSON(stdout, res); perr != nil {
			fmt.Fprintln(stderr, "rl-cleanup:", perr)
			return cli.ExitError
		}
	} else {
		printText(stdout, res)
	}
	if err != nil {
		return cli.ExitError
	}
	return cli.ExitOK
}

// parseFlags parses and validates the command line. It returns ok=false with
// the exit code to use when the program must stop (also for --help).
func parseFlags(args []string, stderr io.Writer) (cfg config, code int, ok bool) {
	fs := flag.NewFlagSet("rl-cleanup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usageText)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.databaseURL, "database-url", "", "PostgreSQL connection URL (default $DATABASE_URL, else the PG* variables)")
	fs.StringVar(&cfg.schema, "schema", "", "schema holding pgrl's tables (default: the connection's search_path)")
	mode := fs.String("mode", "delete", "delete: delete dead rows in batches; partitions: drop past partitions and create upcoming ones (partitioned layout only)")
	partitions := fs.Bool("partitions", false, "same as --mode partitions")
	batchSize := fs.Int("batch-size", cleanup.DefaultBatchSize, "rows deleted per statement")
	maxDuration := fs.Duration("max-duration", 0, "stop between batches after this long, e.g. 2m (default: until done)")
	horizon := fs.Duration("horizon", cleanup.DefaultHorizon, "partition mode: create partitions this far ahead")
	lockTimeout := fs.Duration("lock-timeout", cleanup.DefaultLockTimeout, "longest wait for any lock (the session's lock_timeout)")
	stmtTimeout := fs.Duration("statement-timeout", cleanup.DefaultStatementTimeout, "longest any one statement may run (the session's statement_timeout)")
	batchPause := fs.Duration("batch-pause", 0, "sleep between batches, to leave more of the server to checks")
	fs.BoolVar(&cfg.opts.DryRun, "dry-run", false, "count what would be deleted, dropped and created; change nothing")
	fs.BoolVar(&cfg.opts.Vacuum, "vacuum", false, "VACUUM each table rows were deleted from (autovacuum does this otherwise)")
	fs.StringVar(&cfg.output, "output", "text", "text or json (one JSON object on stdout)")
	fs.DurationVar(&cfg.progress, "progress-every", 5*time.Second, "how often long runs report progress on stderr")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cfg, cli.ExitOK, false
		}
		return cfg, cli.ExitUsage, false
	}
	usage := func(format string, a ...any) (config, int, bool) {
		fmt.Fprintf(stderr, "rl-cleanup: "+format+"\n", a...)
		return cfg, cli.ExitUsage, false
	}
	if fs.NArg() > 0 {
		return usage("unexpected argument %q; rl-cleanup takes only flags (see --help)", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	m, err := cleanup.ParseMode(*mode)
	if err != nil {
		return usage("--mode %q is not a mode; use --mode delete or --mode partitions", *mode)
	}
	if *partitions {
		if set["mode"] && m != cleanup.ModePartitions {
			return usage("--partitions contradicts --mode %s; pass one of them", *mode)
		}
		m = cleanup.ModePartitions
	}
	if *batchSize <= 0 || *batchSize > 1_000_000 {
		return usage("--batch-size %d is out of range; use a number from 1 to 1000000, such as %d", *batchSize, cleanup.DefaultBatchSize)
	}
	if set["max-duration"] && *maxDuration <= 0 {
		return usage("--max-duration %s must be positive, such as 2m (omit it to run until done)", *maxDuration)
	}
	if *horizon <= 0 {
		return usage("--horizon %s must be positive, such as 24h", *horizon)
	}
	if *lockTimeout < time.Millisecond {
		return usage("--lock-timeout %s must be at least 1ms, such as 1s", *lockTimeout)
	}
	if *stmtTimeout < time.Millisecond {
		return usage("--statement-timeout %s must be at least 1ms, such as 30s", *stmtTimeout)
	}
	if *batchPause < 0 {
		return usage("--batch-pause %s must not be negative", *batchPause)
	}
	if cfg.progress <= 0 {
		return usage("--progress-every %s must be positive, such as 5s", cfg.progress)
	}
	switch cfg.output {
	case "text", "json":
	default:
		return usage("--output %q is not a format; use --output text or --output json", cfg.output)
	}
	if set["schema"] && strings.TrimSpace(cfg.schema) == "" {
		return usage("--schema is empty; name the schema holding pgrl's tables, or omit the flag")
	}
	if set["schema"] {
		if err := ident.Check("--schema", cfg.schema); err != nil {
			return usage("%v", err)
		}
	}
	cfg.opts.Mode = m
	cfg.opts.BatchSize = *batchSize
	cfg.opts.MaxDuration = *maxDuration
	cfg.opts.Horizon = *horizon
	cfg.opts.LockTimeout = *lockTimeout
	cfg.opts.StatementTimeout = *stmtTimeout
	cfg.opts.BatchPause = *batchPause
	return cfg, cli.ExitOK, true
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
