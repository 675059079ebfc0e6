package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/ident"
	"github.com/pgrl/pgrl/migration"
)

// version is the tool's version; release builds set it with
// -ldflags "-X main.version=v1.2.3". Otherwise the module version is used.
var version = ""

const usageText = `rl-migrate applies pgrl's schema migrations (the rate-limit counter tables and
their functions) to a PostgreSQL database. Run it in your deploy pipeline before
the application starts; running it again, or from several machines at once, is safe.

Usage:
  rl-migrate [flags] <command> [arguments] [flags]

Commands:
  up [N] [--grant-to ROLE] apply every pending migration (or those up to version N);
                           --grant-to (repeatable, or a comma list) then grants each
                           role the application's rights (USAGE on the schema, DML
                           on the counter tables, SELECT on the policy tables,
                           EXECUTE on pgrl's functions, SELECT on the migrations
                           table for status), also when nothing was pending; every
                           role must exist, which is checked before anything is done.
                           When the database has the citus extension, up distributes
                           the counter tables by key (colocated) and makes the policy
                           and settings tables reference tables, once
  down [--all]             revert the newest applied migration; --all reverts every
                           one and drops pgrl's tables with all their counters
  status [--check]         show the version, applied and pending migrations and the
                           layout (on Citus, each table's distribution); --check exits
                           4 when some are pending, 3 when dirty;
                           the application's role may run it after up --grant-to
  force N                  record version N as applied and clear the dirty flag,
                           running no SQL (N=0: nothing applied); for after a repair
  sql N [up|down]          print migration N's SQL (default up); needs no database
  layout plain|partitioned [--partition-width 1h] [--lookahead 24h]
                           switch pgrl_fixed_window between one table and time
                           partitions, keeping live counters; holds an ACCESS
                           EXCLUSIVE lock on that table while it copies them.
                           Makes the partitions from now to now + --lookahead (at
                           least your longest fixed window; at most 63 widths)
  version                  print this tool's version and its newest migration

Flags:
  --database-url URL       connection string (default: $DATABASE_URL, else the
                           libpq variables PGHOST, PGPORT, PGUSER, PGPASSWORD, ...)
  --schema NAME            schema for pgrl's tables and the migrations table, created
                           if missing (default: the connection's current schema,
                           usually public); at most 63 bytes
  --migrations-table NAME  migrations table (default pgrl_schema_migrations; never
                           golang-migrate's schema_migrations, which is your app's)
  --lock-timeout D         lock_timeout for every statement: DDL fails instead of
                           queueing behind a long transaction (default 5s)
  --lock-wait D            how long to wait for another rl-migrate to finish
                           (default 1m)
  --output text|json       json prints exactly one JSON object on stdout, errors
                           included: {"error": "...", "exit_code": N} (default text)
  --help                   show this help

Examples:
  # apply the migrations (deploy pipeline)
  DATABASE_URL='postgres://app:secret@db.internal:5432/app' rl-migrate up

  # fail a CI step when migrations are pending, with machine-readable output
  rl-migrate --output json status --check

  # keep pgrl's tables in a schema of their own
  rl-migrate --schema ratelimit up

  # read what migration 1 does before applying it
  rl-migrate sql 1 up

  # let rl-cleanup drop whole partitions instead of deleting rows
  rl-migrate layout partitioned --partition-width 1h

  # migrate as the owner and let the application's role run checks
  rl-migrate up --grant-to app

Exit codes: 0 success or nothing to do, 1 error, 2 usage error,
3 dirty migrations table (see force), 4 pending migrations (status --check).
Logs go to stderr, results to stdout.
`

// usageError is a bad flag or argument: exit 2, nothing done.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// exitCode ends a command whose output is already written with a given
// exit code (status --check).
type exitCode int

func (e exitCode) Error() string { return "exit " + strconv.Itoa(int(e)) }

// roleList is a repeatable flag of comma-separated role names.
type roleList []string

func (r *roleList) String() string { return strings.Join(*r, ",") }

func (r *roleList) Set(v string) error {
	*r = append(*r, cli.SplitList(v)...)
	return nil
}

type globals struct {
	databaseURL string
	schema      string
	table       string
	lockTimeout time.Duration
	lockWait    time.Duration
	output      string
	help        bool
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.databaseURL, "database-url", g.databaseURL, "")
	fs.StringVar(&g.schema, "schema", g.schema, "")
	fs.StringVar(&g.table, "migrations-table", g.table, "")
	fs.DurationVar(&g.lockTimeout, "lock-timeout", g.lockTimeout, "")
	fs.DurationVar(&g.lockWait, "lock-wait", g.lockWait, "")
	fs.StringVar(&g.output, "output", g.output, "")
	fs.BoolVar(&g.help, "help", g.help, "")
	fs.BoolVar(&g.help, "h", g.help, "")
}

type app struct {
	stdout, stderr io.Writer
	g              globals
	log            *slog.Logger
	args           []string // the command line as given, for hints
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	a := &app{
		stdout: stdout,
		stderr: stderr,
		g: globals{
			table:       migration.DefaultTable,
			lockTimeout: migration.DefaultLockTimeout,
			lockWait:    migration.DefaultLockWait,
			output:      "text",
		},
		log:  slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
		args: args,
	}
	// Errors in flags that come before --output json are still reported
	// as JSON.
	for i, arg := range args {
		if arg == "--" {
			break
		}
		if arg == "--output=json" || arg == "-output=json" ||
			((arg == "--output" || arg == "-output") && i+1 < len(args) && args[i+1] == "json") {
			a.g.output = "json"
		}
	}
	err := a.dispatch(ctx, args)
	return a.finish(err)
}

func (a *app) jsonOutput() bool { return a.g.output == "json" }

func (a *app) dispatch(ctx context.Context, args []string) error {
	fs := newFlagSet("rl-migrate")
	a.g.register(fs)
	if err := fs.Parse(args); err != nil {
		return flagError(fs, err)
	}
	if err := a.checkGlobals(); err != nil {
		return err
	}
	if a.g.help {
		return a.printHelp()
	}
	if fs.NArg() == 0 {
		return usagef("no command given")
	}
	cmd, rest := fs.Arg(0), fs.Args()[1:]
	sub := newFlagSet("rl-migrate " + cmd)
	a.g.register(sub)
	switch cmd {
	case "up":
		var grantTo roleList
		sub.Var(&grantTo, "grant-to", "")
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) > 1 {
			return usagef("up takes at most one argument, the target version")
		}
		var target uint
		if len(pos) == 1 {
			if target, err = parseVersion(pos[0], false); err != nil {
				return err
			}
		}
		for _, r := range grantTo {
			if err := ident.Check("--grant-to", r); err != nil {
				return usagef("%v", err)
			}
		}
		return a.up(ctx, target, grantTo)
	case "down":
		all := sub.Bool("all", false, "")
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) != 0 {
			return usagef("down takes no argument: it reverts one migration, or all of them with --all")
		}
		return a.down(ctx, *all)
	case "status":
		check := sub.Bool("check", false, "")
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) != 0 {
			return usagef("status takes no argument")
		}
		return a.status(ctx, *check)
	case "force":
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return usagef("force takes one argument, the version to record (0 for none)")
		}
		v, err := parseVersion(pos[0], true)
		if err != nil {
			return err
		}
		return a.force(ctx, v)
	case "sql":
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) < 1 || len(pos) > 2 {
			return usagef("sql takes a version and optionally up or down, e.g. `rl-migrate sql 1 up`")
		}
		v, err := parseVersion(pos[0], false)
		if err != nil {
			return err
		}
		dir := migration.Up
		if len(pos) == 2 {
			dir = migration.Direction(pos[1])
			if dir != migration.Up && dir != migration.Down {
				return usagef("unknown direction %q: use up or down", pos[1])
			}
		}
		return a.sql(v, dir)
	case "layout":
		width := sub.Duration("partition-width", migration.DefaultPartitionWidth, "")
		lookahead := sub.Duration("lookahead", migration.DefaultPartitionLookahead, "")
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) != 1 || (migration.Layout(pos[0]) != migration.LayoutPlain && migration.Layout(pos[0]) != migration.LayoutPartitioned) {
			return usagef("layout takes one argument: plain or partitioned")
		}
		layout := migration.Layout(pos[0])
		if *width < time.Second || *width%time.Second != 0 {
			return usagef("--partition-width must be a whole number of seconds, at least 1s, got %s", *width)
		}
		if *lookahead <= 0 {
			return usagef("--lookahead must be a positive duration such as 24h, got %s", *lookahead)
		}
		if layout == migration.LayoutPartitioned && migration.PartitionsNeeded(*lookahead, *width) > migration.MaxPartitions {
			return usageError{(&migration.PartitionCountError{Width: *width, Lookahead: *lookahead,
				Needed: migration.PartitionsNeeded(*lookahead, *width)}).Error()}
		}
		return a.layout(ctx, layout, *width, *lookahead)
	case "version":
		pos, err := parse(sub, rest, a)
		if err != nil {
			return err
		}
		if len(pos) != 0 {
			return usagef("version takes no argument")
		}
		return a.version()
	case "help":
		return a.printHelp()
	default:
		return usagef("unknown command %q", cmd)
	}
}

func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses a subcommand's flags, which may come before, between or after
// its positional arguments, and returns the positional arguments.
func parse(fs *flag.FlagSet, args []string, a *app) ([]string, error) {
	pos, err := cli.Positional(fs, args)
	if err != nil {
		return nil, flagError(fs, err)
	}
	if err := a.checkGlobals(); err != nil {
		return nil, err
	}
	if a.g.help {
		return nil, a.printHelp()
	}
	return pos, nil
}

func (a *app) checkGlobals() error {
	if a.g.output != "text" && a.g.output != "json" {
		out := a.g.output
		a.g.output = "text"
		return usagef("--output must be text or json, got %q", out)
	}
	if a.g.lockTimeout <= 0 || a.g.lockWait <= 0 {
		return usagef("--lock-timeout and --lock-wait must be positive durations such as 5s or 1m")
	}
	if a.g.table == "" {
		return usagef("--migrations-table must not be empty")
	}
	if err := ident.Check("--migrations-table", a.g.table); err != nil {
		return usagef("%v", err)
	}
	if a.g.schema != "" {
		if err := ident.Check("--schema", a.g.schema); err != nil {
			return usagef("%v", err)
		}
	}
	return nil
}

func parseVersion(s string, zeroOK bool) (uint, error) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || (n == 0 && !zeroOK) {
		return 0, usagef("%q is not a migration version; available versions: %s", s, versions())
	}
	return uint(n), nil
}

func versions() string {
	var parts []string
	for _, m := range migration.Available() {
		parts = append(parts, fmt.Sprintf("%d (%s)", m.Version, m.Name))
	}
	return strings.Join(parts, ", ")
}

// helpShown ends dispatch after --help.
type helpShown struct{}

func (helpShown) Error() string { return "help shown" }

func (a *app) printHelp() error {
	if a.jsonOutput() {
		_ = cli.PrintJSON(a.stdout, map[string]any{"usage": usageText})
	} else {
		_, _ = io.WriteString(a.stdout, usageText)
	}
	return helpShown{}
}

// finish prints an error (if any) and maps it to an exit code.
func (a *app) finish(err error) int {
	if err == nil {
		return cli.ExitOK
	}
	var hs helpShown
	if errors.As(err, &hs) {
		return cli.ExitOK
	}
	var ec exitCode
	if errors.As(err, &ec) {
		return int(ec)
	}
	code := cli.ExitError
	var ue usageError
	switch {
	case errors.As(err, &ue):
		code = cli.ExitUsage
	case errors.Is(err, migration.ErrDirty):
		code = cli.ExitDirty
	case errors.Is(err, migration.ErrInvalidConfig):
		code = cli.ExitUsage
	}
	var uv *migration.UnknownVersionError
	if errors.As(err, &uv) && !uv.InDatabase {
		code = cli.ExitUsage
	}
	msg := explain(err)
	var mr *migration.MissingRoleError
	switch {
	case errors.As(err, &mr):
		msg = strings.TrimPrefix(msg, "pgrl migration: ") + ", then run `" + a.commandLine() + "` again"
	case code == cli.ExitUsage && !a.jsonOutput():
		msg += "; run `rl-migrate --help` for usage"
	}
	if a.jsonOutput() {
		_ = cli.PrintJSON(a.stdout, map[string]any{"error": msg, "exit_code": code})
	} else {
		fmt.Fprintln(a.stderr, "rl-migrate: "+msg)
	}
	return code
}

// explain turns an error into one line naming the fix.
func explain(err error) string {
	var msg string
	var fe *migration.FailedError
	switch {
	case errors.As(err, &fe):
		msg = fmt.Sprintf("migration %s %s failed and was rolled back, the database stays at version %d: %s",
			fe.Migration, fe.Direction, fe.Version, cli.Explain(fe.Err))
	case errors.Is(err, migration.ErrDirty), errors.Is(err, migration.ErrUnknownVersion),
		errors.Is(err, migration.ErrLockWait), errors.Is(err, migration.ErrNotMigrated),
		errors.Is(err, migration.ErrInvalidConfig), errors.Is(err, migration.ErrPermission):
		msg = err.Error()
	case errors.Is(err, context.Canceled):
		msg = "interrupted: " + err.Error() + "; run the command again to finish"
	default:
		var ue usageError
		if errors.As(err, &ue) {
			msg = ue.msg
		} else {
			msg = cli.Explain(err)
		}
	}
	return strings.Join(strings.Fields(msg), " ")
}

func (a *app) migrator(opts ...func(*migration.Config)) (*migration.Migrator, error) {
	conn, source := cli.ConnString(a.g.databaseURL)
	cfg, err := cli.ParseConfig(conn, "rl-migrate")
	if err != nil {
		return nil, err
	}
	a.log.Debug("connection", "from", source)
	mc := migration.Config{
		Schema:      a.g.schema,
		Table:       a.g.table,
		LockTimeout: a.g.lockTimeout,
		LockWait:    a.g.lockWait,
		Logger:      a.log,
	}
	for _, o := range opts {
		o(&mc)
	}
	return migration.NewWithConnConfig(cfg, mc)
}

type resultOut struct {
	Command string `json:"command"`
	migration.Result
	Changed bool `json:"changed"`
}

func (a *app) printResult(cmd string, res migration.Result) error {
	if a.jsonOutput() {
		return cli.PrintJSON(a.stdout, resultOut{Command: cmd, Result: res, Changed: res.Changed()})
	}
	switch {
	case len(res.Applied) > 0:
		_, err := fmt.Fprintf(a.stdout, "schema %s: migrated from version %d to %d (applied %s)\n", res.Schema, res.From, res.To, names(res.Applied))
		return err
	case len(res.Reverted) > 0:
		_, err := fmt.Fprintf(a.stdout, "schema %s: migrated from version %d down to %d (reverted %s)\n", res.Schema, res.From, res.To, names(res.Reverted))
		return err
	default:
		_, err := fmt.Fprintf(a.stdout, "schema %s: nothing to do, at version %d\n", res.Schema, res.To)
		return err
	}
}

func names(ms []migration.Migration) string {
	parts := make([]string, len(ms))
	for i, m := range ms {
		parts[i] = m.String()
	}
	return strings.Join(parts, ", ")
}

func (a *app) up(ctx context.Context, target uint, grantTo []string) error {
	if target != 0 {
		if _, err := migration.Lookup(target); err != nil {
			return err
		}
	}
	m, err := a.migrator(func(c *migration.Config) { c.GrantTo = grantTo })
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	var res migration.Result
	if target == 0 {
		res, err = m.Up(ctx)
	} else {
		res, err = m.UpTo(ctx, target)
	}
	if err != nil {
		return err
	}
	return a.printResult("up", res)
}

func (a *app) down(ctx context.Context, all bool) error {
	m, err := a.migrator()
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	var res migration.Result
	if all {
		res, err = m.DownAll(ctx)
	} else {
		res, err = m.Down(ctx, 1)
	}
	if err != nil {
		return err
	}
	return a.printResult("down", res)
}

type statusOut struct {
	Command string `json:"command"`
	migration.Status
	PartitionWidthSeconds int64 `json:"partition_width_seconds,omitempty"`
}

func (a *app) status(ctx context.Context, check bool) error {
	m, err := a.migrator()
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	st, err := m.Status(ctx)
	if err != nil {
		return err
	}
	if a.jsonOutput() {
		if err := cli.PrintJSON(a.stdout, statusOut{Command: "status", Status: st, PartitionWidthSeconds: int64(st.PartitionWidth / time.Second)}); err != nil {
			return err
		}
	} else {
		layout := string(st.Layout)
		switch st.Layout {
		case "":
			layout = "(no pgrl tables)"
		case migration.LayoutPartitioned:
			layout += fmt.Sprintf(" (partitions of %s)", st.PartitionWidth)
		}
		pending := names(st.Pending)
		if pending == "" {
			pending = "none"
		}
		applied := names(st.Applied)
		if applied == "" {
			applied = "none"
		}
		fmt.Fprintf(a.stdout, "schema:           %s\nmigrations table: %s\nversion:          %d (latest %d)\ndirty:            %t\nlayout:           %s\napplied:          %s\npending:          %s\n",
			st.Schema, st.Table, st.Version, st.Latest, st.Dirty, layout, applied, pending)
		if st.Citus {
			// On Citus, how each table is stored (see migration.Distribute).
			fmt.Fprintf(a.stdout, "citus:            yes\n")
			for _, d := range st.Distribution {
				fmt.Fprintf(a.stdout, "  %-22s %s\n", d.Table, d)
			}
		}
		if st.Dirty {
			fmt.Fprintln(a.stderr, "rl-migrate: "+(&migration.DirtyError{Version: st.Version, Table: st.Schema + "." + st.Table}).Error())
		}
	}
	if check {
		if st.Dirty {
			return exitCode(cli.ExitDirty)
		}
		if len(st.Pending) > 0 {
			if !a.jsonOutput() {
				// Check names the database, the user and the schema.
				err := m.Check(ctx)
				if !errors.Is(err, migration.ErrPending) {
					return err
				}
				fmt.Fprintln(a.stderr, "rl-migrate: "+err.Error())
			}
			return exitCode(cli.ExitPending)
		}
	}
	return nil
}

func (a *app) force(ctx context.Context, v uint) error {
	if v != 0 {
		if _, err := migration.Lookup(v); err != nil {
			return err
		}
	}
	m, err := a.migrator()
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	if err := m.Force(ctx, v); err != nil {
		return err
	}
	st, err := m.Status(ctx)
	if err != nil {
		return err
	}
	if a.jsonOutput() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "force", "schema": st.Schema, "version": v, "dirty": st.Dirty})
	}
	_, err = fmt.Fprintf(a.stdout, "schema %s: recorded version %d, not dirty\n", st.Schema, v)
	return err
}

func (a *app) sql(v uint, dir migration.Direction) error {
	body, err := migration.SQL(v, dir)
	if err != nil {
		return err
	}
	if a.jsonOutput() {
		m, _ := migration.Lookup(v)
		return cli.PrintJSON(a.stdout, map[string]any{"command": "sql", "version": v, "name": m.Name, "direction": dir, "sql": body})
	}
	_, err = io.WriteString(a.stdout, body)
	return err
}

func (a *app) layout(ctx context.Context, layout migration.Layout, width, lookahead time.Duration) error {
	m, err := a.migrator(func(c *migration.Config) { c.PartitionLookahead = lookahead })
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	got, err := m.SetLayout(ctx, layout, width)
	if err != nil {
		return err
	}
	st, err := m.Status(ctx)
	if err != nil {
		return err
	}
	if a.jsonOutput() {
		out := map[string]any{"command": "layout", "schema": st.Schema, "layout": got}
		if got == migration.LayoutPartitioned {
			out["partition_width_seconds"] = int64(st.PartitionWidth / time.Second)
		}
		return cli.PrintJSON(a.stdout, out)
	}
	if got == migration.LayoutPartitioned {
		_, err = fmt.Fprintf(a.stdout, "schema %s: pgrl_fixed_window is partitioned (partitions of %s)\n", st.Schema, st.PartitionWidth)
		return err
	}
	_, err = fmt.Fprintf(a.stdout, "schema %s: pgrl_fixed_window is plain\n", st.Schema)
	return err
}

func toolVersion() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

func (a *app) version() error {
	latest := migration.Latest()
	if a.jsonOutput() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "version", "version": toolVersion(), "latest_migration": latest})
	}
	_, err := fmt.Fprintf(a.stdout, "rl-migrate %s, latest migration %s\n", toolVersion(), latest)
	return err
}
