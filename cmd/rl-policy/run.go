package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/ident"
	"github.com/pgrl/pgrl/internal/notmigrated"
	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

const usageText = `rl-policy manages the rate limits stored in PostgreSQL (tables pgrl_policy and
pgrl_policy_override, from rl-migrate's migration 7): named policies, overrides of
one key's limit, and why a key is limited. Every change is one transaction and is
announced to the applications' listeners (NOTIFY pgrl_policy), which apply it
within a second. Run it as the migration role: the application role may only read.

Usage:
  rl-policy [flags] <command> [arguments] [flags]

Commands:
  set NAME [--limit N] [--window D] [--algorithm A] [--burst N] [--penalty[=false]]
           [--key-mode hashed|readable] [--description TEXT]
                           create the policy (--limit and --window required) or
                           change the fields given, keeping the others; --burst 0
                           is the default (the limit)
  get NAME                 show one policy
  list                     show every policy
  delete NAME              delete the policy and its overrides
  apply FILE [--prune] [--dry-run]
                           make the stored policies those of FILE (- for stdin),
                           in one transaction: a JSON object {"policies": [...]}
                           as "rl-policy --output json list" prints it (window as
                           a duration such as "1m"); --prune also deletes the
                           policies FILE lacks (with their overrides); --dry-run
                           prints the changes and makes none; a field FILE
                           does not know is refused
  explain NAME KEY         show the policy, the override in force for KEY, the
                           limit that applies and KEY's counter (counts nothing)
  override set NAME KEY [--limit N] [--window D] [--burst N]
           [--expires-in D | --expires-at TIME] [--note TEXT]
                           give KEY its own limit, window or burst (at least one),
                           until the expiry if any (TIME in RFC 3339, in the
                           future; delete an override to end it)
  override list [NAME]     show the overrides (of one policy), expired ones too
  override delete NAME KEY delete KEY's override
                           (override set and delete take --stored-key HEX instead
                           of KEY: the key as stored, from override list)
  key get|reset NAME KEY [--key-hex HEX] [--algorithm A --limit N --window D ...]
                           show or delete KEY's counter under any limiter, a stored
                           policy or one defined in code (the application role may
                           run both); docs/KEYS.md
  version                  print this tool's version

Flags:
  --database-url URL       connection string (default: $DATABASE_URL, else the
                           libpq variables PGHOST, PGPORT, PGUSER, PGPASSWORD, ...)
  --schema NAME            schema holding pgrl's tables (default: the connection's
                           search_path)
  --lock-timeout D         lock_timeout of every statement (default 5s)
  --output text|json       json prints exactly one JSON object on stdout, errors
                           included: {"error": "...", "exit_code": N} (default text)
  --help                   show this help

Durations are Go durations (90s, 15m, 24h); windows run from 1ms to 8784h (366 days).
Algorithms: fixed_window (default), token_bucket, sliding_window.

Examples:
  rl-policy set api --limit 100 --window 1m
  rl-policy set api --limit 200                   # change the limit only
  rl-policy override set api tenant-42 --limit 1000 --expires-in 720h --note "trial, ticket 123"
  rl-policy explain api tenant-42
  rl-policy --output json list > policies.json   # edit, review, then:
  rl-policy apply policies.json --prune --dry-run

Exit codes: 0 success, 1 error (database, not found), 2 usage error or a value
the policy tables refuse (nothing was written).
`

// version is the tool's version; release builds set it with
// -ldflags "-X main.version=v1.2.3". Otherwise the module version is used.
var version = ""

// usageError is a bad flag, argument or value: exit 2, nothing done.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

type helpShown struct{}

func (helpShown) Error() string { return "help shown" }

type globals struct {
	databaseURL string
	schema      string
	lockTimeout time.Duration
	output      string
	help        bool
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.databaseURL, "database-url", g.databaseURL, "")
	fs.StringVar(&g.schema, "schema", g.schema, "")
	fs.Var(durationFlag{&g.lockTimeout}, "lock-timeout", "")
	fs.StringVar(&g.output, "output", g.output, "")
	fs.BoolVar(&g.help, "help", g.help, "")
	fs.BoolVar(&g.help, "h", g.help, "")
}

type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	g              globals
	writes         bool // the command writes policies or overrides
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	a := &app{stdin: os.Stdin, stdout: stdout, stderr: stderr, g: globals{lockTimeout: 5 * time.Second, output: "text"}}
	for i, arg := range args {
		if arg == "--" {
			break
		}
		if arg == "--output=json" || arg == "-output=json" ||
			((arg == "--output" || arg == "-output") && i+1 < len(args) && args[i+1] == "json") {
			a.g.output = "json"
		}
	}
	return a.finish(a.dispatch(ctx, args))
}

func (a *app) json() bool { return a.g.output == "json" }

func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parse parses flags placed anywhere among the positional arguments and
// returns those arguments.
func (a *app) parse(fs *flag.FlagSet, args []string) ([]string, error) {
	pos, err := cli.Positional(fs, args)
	if err != nil {
		return nil, usagef("%s: %v", fs.Name(), err)
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
	if a.g.lockTimeout <= 0 {
		return usagef("--lock-timeout must be a positive duration such as 5s")
	}
	if a.g.schema != "" {
		if err := ident.Check("--schema", a.g.schema); err != nil {
			return usagef("%v", err)
		}
	}
	return nil
}

func (a *app) printHelp() error {
	if a.json() {
		_ = cli.PrintJSON(a.stdout, map[string]any{"usage": usageText})
	} else {
		_, _ = io.WriteString(a.stdout, usageText)
	}
	return helpShown{}
}

// rateFlags are the flags that set a limit, a window and a burst.
type rateFlags struct {
	limit  int64
	window time.Duration
	burst  int64
}

func (r *rateFlags) register(fs *flag.FlagSet) {
	fs.Var(int64Flag{&r.limit}, "limit", "")
	fs.Var(durationFlag{&r.window}, "window", "")
	fs.Var(int64Flag{&r.burst}, "burst", "")
}

// durationFlag is a flag.Value holding a Go duration, whose error gives
// examples (the flag package's own says "parse error" only).
type durationFlag struct{ d *time.Duration }

func (f durationFlag) String() string {
	if f.d == nil {
		return ""
	}
	return f.d.String()
}

func (f durationFlag) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("not a duration: use a duration such as 90s, 15m or 24h (units ms, s, m, h; no d)")
	}
	*f.d = d
	return nil
}

// int64Flag is a flag.Value holding a whole number, whose error gives an
// example.
type int64Flag struct{ v *int64 }

func (f int64Flag) String() string {
	if f.v == nil {
		return ""
	}
	return strconv.FormatInt(*f.v, 10)
}

func (f int64Flag) Set(s string) error {
	v, err := strconv.ParseInt(s, 10, 64)
	if errors.Is(err, strconv.ErrRange) {
		return fmt.Errorf("out of range: use a whole number from 1 to %d", int64(math.MaxInt64))
	}
	if err != nil {
		return errors.New("not a whole number: use a number such as 100")
	}
	*f.v = v
	return nil
}

func given(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

func (a *app) dispatch(ctx context.Context, args []string) error {
	fs := newFlagSet("rl-policy")
	a.g.register(fs)
	if err := fs.Parse(args); err != nil {
		return usagef("%v", err)
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
	a.writes = cmd == "set" || cmd == "delete" || cmd == "apply" ||
		(cmd == "override" && len(rest) > 0 && (rest[0] == "set" || rest[0] == "delete"))
	sub := newFlagSet("rl-policy " + cmd)
	a.g.register(sub)
	switch cmd {
	case "set":
		var r rateFlags
		r.register(sub)
		alg := sub.String("algorithm", "", "")
		penalty := sub.Bool("penalty", false, "")
		keyMode := sub.String("key-mode", "", "")
		desc := sub.String("description", "", "")
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return usagef("set takes one argument, the policy's name, e.g. `rl-policy set api --limit 100 --window 1m`")
		}
		set := given(sub)
		var mode ratelimit.KeyMode
		if set["key-mode"] {
			if mode, err = policy.ParseKeyMode(*keyMode); err != nil || *keyMode == "" {
				return usagef("--key-mode must be hashed or readable, got %q", *keyMode)
			}
		}
		if set["algorithm"] {
			if _, err := ratelimit.ParseAlgorithm(*alg); err != nil {
				return usagef("--algorithm %q: use fixed_window, token_bucket or sliding_window", *alg)
			}
		}
		return a.set(ctx, pos[0], set, func(p *policy.Policy) {
			if set["limit"] {
				p.Limit = r.limit
			}
			if set["window"] {
				p.Window = r.window
			}
			if set["burst"] {
				p.Burst = r.burst
			}
			if set["algorithm"] {
				p.Algorithm = ratelimit.Algorithm(*alg)
			}
			if set["penalty"] {
				p.Penalty = *penalty
			}
			if set["key-mode"] {
				p.KeyMode = mode
			}
			if set["description"] {
				p.Description = *desc
			}
		})
	case "get", "delete":
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return usagef("%s takes one argument, the policy's name", cmd)
		}
		if cmd == "get" {
			return a.get(ctx, pos[0])
		}
		return a.delete(ctx, pos[0])
	case "list":
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) != 0 {
			return usagef("list takes no argument")
		}
		return a.list(ctx)
	case "apply":
		prune := sub.Bool("prune", false, "")
		dry := sub.Bool("dry-run", false, "")
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return usagef("apply takes one argument, the file of policies (- for stdin)")
		}
		want, err := readPolicies(pos[0], a.stdin)
		if err != nil {
			return err
		}
		return a.apply(ctx, want, *prune, *dry)
	case "explain":
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) != 2 {
			return usagef("explain takes two arguments, the policy's name and the key, e.g. `rl-policy explain api 203.0.113.7`")
		}
		return a.explain(ctx, pos[0], pos[1])
	case "override":
		if len(rest) == 0 {
			return usagef("override needs a subcommand: set, list or delete")
		}
		return a.override(ctx, rest[0], rest[1:])
	case "key":
		return a.key(ctx, rest)
	case "version":
		pos, err := a.parse(sub, rest)
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

func (a *app) override(ctx context.Context, cmd string, rest []string) error {
	sub := newFlagSet("rl-policy override " + cmd)
	a.g.register(sub)
	storedHex := sub.String("stored-key", "", "")
	switch cmd {
	case "set":
		var r rateFlags
		r.register(sub)
		expiresIn := new(time.Duration)
		sub.Var(durationFlag{expiresIn}, "expires-in", "")
		expiresAt := sub.String("expires-at", "", "")
		note := sub.String("note", "", "")
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		set := given(sub)
		name, key, err := keyArgs("override set", pos, set["stored-key"])
		if err != nil {
			return err
		}
		if !set["limit"] && !set["window"] && !set["burst"] {
			return usagef("override set needs at least one of --limit, --window and --burst")
		}
		if set["expires-in"] && set["expires-at"] {
			return usagef("give --expires-in or --expires-at, not both")
		}
		o := policy.Override{Policy: name, Limit: r.limit, Window: r.window, Burst: r.burst, Note: *note}
		if set["expires-in"] {
			if *expiresIn <= 0 {
				return usagef("--expires-in must be a positive duration such as 24h, got %s", *expiresIn)
			}
			o.ExpiresAt = time.Now().Add(*expiresIn)
		}
		if set["expires-at"] {
			if o.ExpiresAt, err = time.Parse(time.RFC3339, *expiresAt); err != nil {
				return usagef("--expires-at %q: use RFC 3339, such as %s", *expiresAt, exampleInstant())
			}
			if !o.ExpiresAt.After(time.Now()) {
				return usagef("--expires-at %s is in the past, so the override would never apply: give a later instant, such as %s, or --expires-in such as 720h; to end an override now, run `rl-policy override delete %s KEY`",
					*expiresAt, exampleInstant(), name)
			}
		}
		if set["stored-key"] {
			if o.Key, err = hex.DecodeString(strings.TrimPrefix(*storedHex, `\x`)); err != nil || len(o.Key) == 0 {
				return usagef("--stored-key %q is not hexadecimal bytes; copy key_hex from `rl-policy override list`", *storedHex)
			}
		}
		return a.overrideSet(ctx, o, key, set["stored-key"])
	case "list":
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		if len(pos) > 1 {
			return usagef("override list takes at most one argument, the policy's name")
		}
		name := ""
		if len(pos) == 1 {
			name = pos[0]
		}
		return a.overrideList(ctx, name)
	case "delete":
		pos, err := a.parse(sub, rest)
		if err != nil {
			return err
		}
		set := given(sub)
		name, key, err := keyArgs("override delete", pos, set["stored-key"])
		if err != nil {
			return err
		}
		var stored []byte
		if set["stored-key"] {
			if stored, err = hex.DecodeString(strings.TrimPrefix(*storedHex, `\x`)); err != nil || len(stored) == 0 {
				return usagef("--stored-key %q is not hexadecimal bytes; copy key_hex from `rl-policy override list`", *storedHex)
			}
		}
		return a.overrideDelete(ctx, name, key, stored)
	default:
		return usagef("unknown override subcommand %q: use set, list or delete", cmd)
	}
}

// exampleInstant is an instant 30 days ahead, in RFC 3339, for messages.
func exampleInstant() string {
	return time.Now().Add(30 * 24 * time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339)
}

// keyArgs reads NAME KEY, or NAME alone with --stored-key.
func keyArgs(cmd string, pos []string, stored bool) (name, key string, err error) {
	switch {
	case stored && len(pos) == 1:
		return pos[0], "", nil
	case !stored && len(pos) == 2:
		return pos[0], pos[1], nil
	case stored:
		return "", "", usagef("%s takes the policy's name and --stored-key, without a KEY argument", cmd)
	}
	return "", "", usagef("%s takes two arguments, the policy's name and the key (or --stored-key HEX instead of the key)", cmd)
}

// explainAccess replaces a not-migrated or permission error with one that
// names the grants the command's role lacks (a schema without USAGE hides
// the tables, which then look missing), read from the catalog on a
// connection of its own. A not-migrated error that no missing grant
// explains names where the command looked (whereNotMigrated). err is
// returned as it was when the catalog cannot be read.
func (a *app) explainAccess(err error) error {
	var known *pgerr.PermissionError
	if errors.As(err, &known) && known.Role != "" {
		return err // read from the catalog already
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, cerr := a.connect(ctx)
	if cerr != nil {
		return err
	}
	defer closeConn(conn)
	need := pgerr.PolicyRead
	if a.writes {
		need = pgerr.PolicyWrite
	}
	if pe := pgerr.Diagnose(ctx, conn, need, err); pe != nil {
		return pe
	}
	if errors.Is(err, policy.ErrNotMigrated) {
		return a.whereNotMigrated(err)
	}
	return err
}

// whereNotMigrated replaces a not-migrated error with one that names the
// database, the user and the schema the command looked in (and says so when
// no database URL was configured), read on a connection of its own; err
// as it was when that cannot be read.
func (a *app) whereNotMigrated(err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, cerr := a.connect(ctx)
	if cerr != nil {
		return err
	}
	defer closeConn(conn)
	var where *notmigrated.Error
	if !errors.As(notmigrated.At(ctx, conn, "pgrl_policy", "pgrl_policy_override"), &where) {
		return err
	}
	given, _ := cli.ConnString(a.g.databaseURL)
	where.NoURL = notmigrated.DefaultsOnly(given)
	return where
}

// connect opens one connection with search_path set to --schema.
func (a *app) connect(ctx context.Context) (*pgx.Conn, error) {
	conn, _ := cli.ConnString(a.g.databaseURL)
	cfg, err := cli.ParseConfig(conn, "rl-policy")
	if err != nil {
		return nil, usageError{err.Error()}
	}
	settings := map[string]string{"lock_timeout": strconv.FormatInt(a.g.lockTimeout.Milliseconds(), 10)}
	if a.g.schema != "" {
		settings["search_path"] = pgx.Identifier{a.g.schema}.Sanitize()
	}
	return cli.Connect(ctx, cfg, settings)
}

func closeConn(c *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = c.Close(ctx)
}

// set reads the policy (if any) with its row locked, applies the flags
// given, validates and writes it, in one transaction (policy.Update), so
// that concurrent sets of different fields all apply.
func (a *app) set(ctx context.Context, name string, given map[string]bool, apply func(*policy.Policy)) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	created := false
	out, err := policy.Update(ctx, conn, name, func(p *policy.Policy) error {
		created = p.CreatedAt.IsZero()
		if created && (!given["limit"] || !given["window"]) {
			return usagef("policy %q does not exist yet: give --limit and --window to create it, e.g. `rl-policy set %s --limit 100 --window 1m`", name, name)
		}
		apply(p)
		return nil
	})
	if err != nil {
		return err
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "set", "created": created, "policy": policyJSON(out)})
	}
	verb := "updated"
	if created {
		verb = "created"
	}
	fmt.Fprintf(a.stdout, "%s policy %s: %s\n", verb, out.Name, out.Summary())
	return nil
}

func (a *app) get(ctx context.Context, name string) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	p, err := policy.Get(ctx, conn, name)
	if err != nil {
		return err
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "get", "policy": policyJSON(p)})
	}
	a.printPolicies([]policy.Policy{p})
	return nil
}

func (a *app) list(ctx context.Context) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	ps, err := policy.List(ctx, conn)
	if err != nil {
		return err
	}
	if a.json() {
		out := make([]map[string]any, len(ps))
		for i, p := range ps {
			out[i] = policyJSON(p)
		}
		return cli.PrintJSON(a.stdout, map[string]any{"command": "list", "policies": out})
	}
	if len(ps) == 0 {
		fmt.Fprintln(a.stdout, "no policies; create one with `rl-policy set NAME --limit N --window D`")
		return nil
	}
	a.printPolicies(ps)
	return nil
}

func (a *app) printPolicies(ps []policy.Policy) {
	w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tALGORITHM\tLIMIT\tWINDOW\tBURST\tPENALTY\tKEYS\tUPDATED\tDESCRIPTION")
	for _, p := range ps {
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%s\t%v\t%s\t%s\t%s\n", p.Name, p.Algorithm, p.Limit, p.Window, burstText(p.Burst),
			p.Penalty, keyModeText(p.KeyMode), p.UpdatedAt.UTC().Format(time.RFC3339), p.Description)
	}
	_ = w.Flush()
}

func (a *app) delete(ctx context.Context, name string) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	if err := policy.Delete(ctx, conn, name); err != nil {
		return err
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "delete", "policy": name})
	}
	fmt.Fprintf(a.stdout, "deleted policy %s and its overrides\n", name)
	return nil
}

func (a *app) explain(ctx context.Context, name, key string) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	x, err := policy.Explain(ctx, conn, name, key)
	if err != nil {
		return err
	}
	if a.json() {
		out := map[string]any{
			"command": "explain", "policy": policyJSON(x.Policy), "key": x.Key,
			"stored_key_hex": hex.EncodeToString(x.StoredKey),
			"override":       nil, "expired_override": nil, "ignored_override": nil,
			"rate": map[string]any{"limit": x.Rate.Limit, "window": x.Rate.Window.String(),
				"window_seconds": x.Rate.Window.Seconds(), "burst": explainBurst(x)},
			"counter": map[string]any{"allowed": x.Counter.Allowed, "used": x.Counter.Used,
				"remaining": x.Counter.Remaining, "limit": x.Counter.Limit,
				"reset_at": x.Counter.ResetAt.UTC().Format(time.RFC3339Nano), "retry_after_seconds": x.Counter.RetryAfterSeconds()},
		}
		if x.Override != nil {
			out["override"] = overrideJSON(*x.Override, x.Policy)
		}
		if x.Expired != nil {
			out["expired_override"] = overrideJSON(*x.Expired, x.Policy)
		}
		if x.Ignored != "" {
			out["ignored_override"] = x.Ignored
		}
		return cli.PrintJSON(a.stdout, out)
	}
	fmt.Fprintf(a.stdout, "policy     %s: %s\n", x.Policy.Name, x.Policy.Summary())
	fmt.Fprintf(a.stdout, "key        %q (stored as %x)\n", x.Key, x.StoredKey)
	switch {
	case x.Override != nil:
		fmt.Fprintf(a.stdout, "override   %s\n", describeOverride(*x.Override, x.Policy))
	case x.Ignored != "":
		fmt.Fprintf(a.stdout, "override   ignored: %s\n", x.Ignored)
	case x.Expired != nil:
		fmt.Fprintf(a.stdout, "override   expired at %s: the policy applies\n", x.Expired.ExpiresAt.UTC().Format(time.RFC3339))
	default:
		fmt.Fprintln(a.stdout, "override   none: the policy applies")
	}
	if x.Policy.Algorithm == ratelimit.TokenBucket {
		fmt.Fprintf(a.stdout, "applies    %d per %s, burst %d\n", x.Rate.Limit, x.Rate.Window, x.Rate.Burst)
	} else {
		fmt.Fprintf(a.stdout, "applies    %d per %s\n", x.Rate.Limit, x.Rate.Window)
	}
	c := x.Counter
	state := "allowed"
	if !c.Allowed {
		state = fmt.Sprintf("denied, retry after %ds", c.RetryAfterSeconds())
	}
	fmt.Fprintf(a.stdout, "counter    used %d of %d, %d remaining, resets at %s: next check %s\n",
		c.Used, c.Limit, c.Remaining, c.ResetAt.UTC().Format(time.RFC3339), state)
	return nil
}

func (a *app) overrideSet(ctx context.Context, o policy.Override, key string, stored bool) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	var p policy.Policy
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		var err error
		if _, err = policy.Get(ctx, tx, o.Policy); err != nil {
			return err // not found, not migrated, no privilege: in words
		}
		// Then the policy's row is held against writers until commit, so
		// that the key mode the stored key is computed in, and the rate
		// the override is checked against, are those it is written under
		// (the locks the override's trigger needs to update the row, taken
		// first: see policy.SetOverride).
		if _, err = tx.Exec(ctx, `LOCK TABLE pgrl_policy IN ROW EXCLUSIVE MODE`); err != nil {
			return err
		}
		if _, err = tx.Exec(ctx, `SELECT FROM pgrl_policy WHERE name = $1 FOR NO KEY UPDATE`, o.Policy); err != nil {
			return err
		}
		if p, err = policy.Get(ctx, tx, o.Policy); err != nil {
			return err
		}
		if !stored {
			o.Key = p.StoredKey(key)
		} else if err := p.CheckStoredKey(o.Key); errors.Is(err, ratelimit.ErrKeyTooLong) {
			return err
		} else if err != nil {
			return usagef("--stored-key %x is not a stored key of policy %s, whose keys are %s, so the override would never apply: copy key_hex from `rl-policy override list %s`, or give the key itself as the KEY argument instead of --stored-key",
				o.Key, p.Name, keyModeText(p.KeyMode), p.Name)
		}
		o, err = policy.SetOverride(ctx, tx, o)
		return err
	})
	if err != nil {
		return err
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "override set", "override": overrideJSON(o, p)})
	}
	fmt.Fprintf(a.stdout, "override of %s for key %x: %s\n", o.Policy, o.Key, describeOverride(o, p))
	return nil
}

func (a *app) overrideList(ctx context.Context, name string) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	policies := map[string]policy.Policy{}
	if name != "" {
		p, err := policy.Get(ctx, conn, name)
		if err != nil {
			return err
		}
		policies[name] = p
	} else {
		ps, err := policy.List(ctx, conn)
		if err != nil {
			return err
		}
		for _, p := range ps {
			policies[p.Name] = p
		}
	}
	os, err := policy.ListOverrides(ctx, conn, name)
	if err != nil {
		return err
	}
	if a.json() {
		out := make([]map[string]any, len(os))
		for i, o := range os {
			out[i] = overrideJSON(o, policies[o.Policy])
		}
		return cli.PrintJSON(a.stdout, map[string]any{"command": "override list", "overrides": out})
	}
	if len(os) == 0 {
		fmt.Fprintln(a.stdout, "no overrides")
		return nil
	}
	w := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "POLICY\tKEY\tLIMIT\tWINDOW\tBURST\tEXPIRES\tNOTE")
	for _, o := range os {
		exp := "never"
		if !o.ExpiresAt.IsZero() {
			exp = o.ExpiresAt.UTC().Format(time.RFC3339)
			if !o.Applies(time.Now()) {
				exp += " (expired)"
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", o.Policy, keyText(o, policies[o.Policy]), inherit(o.Limit),
			inheritDuration(o.Window), inherit(o.Burst), exp, o.Note)
	}
	return w.Flush()
}

func (a *app) overrideDelete(ctx context.Context, name, key string, stored []byte) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	if stored == nil {
		p, err := policy.Get(ctx, conn, name)
		if err != nil {
			return err
		}
		stored = p.StoredKey(key)
	}
	if err := policy.DeleteOverride(ctx, conn, name, stored); err != nil {
		return err
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "override delete", "policy": name, "key_hex": hex.EncodeToString(stored)})
	}
	fmt.Fprintf(a.stdout, "deleted the override of %s for key %x\n", name, stored)
	return nil
}

func (a *app) version() error {
	v := version
	if v == "" {
		v = "(devel)"
		if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
			v = bi.Main.Version
		}
	}
	if a.json() {
		return cli.PrintJSON(a.stdout, map[string]any{"command": "version", "version": v})
	}
	fmt.Fprintf(a.stdout, "rl-policy %s\n", v)
	return nil
}

func (a *app) finish(err error) int {
	if err == nil {
		return cli.ExitOK
	}
	var hs helpShown
	if errors.As(err, &hs) {
		return cli.ExitOK
	}
	code := cli.ExitError
	var ue usageError
	if errors.As(err, &ue) || errors.Is(err, policy.ErrInvalid) {
		code = cli.ExitUsage
	}
	if errors.Is(err, policy.ErrNotMigrated) || errors.Is(err, policy.ErrPermission) {
		err = a.explainAccess(err)
	}
	var msg string
	switch {
	case errors.As(err, &ue):
		msg = ue.msg
	case errors.Is(err, policy.ErrInvalid), errors.Is(err, policy.ErrNotFound),
		errors.Is(err, policy.ErrPermission), errors.Is(err, policy.ErrNotMigrated):
		msg = err.Error()
	case errors.Is(err, context.Canceled):
		msg = "interrupted: " + err.Error() + "; nothing was written unless the command printed its result"
	default:
		msg = cli.Explain(err)
	}
	msg = strings.Join(strings.Fields(msg), " ")
	if code == cli.ExitUsage && !a.json() {
		msg += "; run `rl-policy --help` for usage"
	}
	if a.json() {
		_ = cli.PrintJSON(a.stdout, map[string]any{"error": msg, "exit_code": code})
	} else {
		fmt.Fprintln(a.stderr, "rl-policy: "+msg)
	}
	return code
}

// describeOverride describes o in words; the burst only under a token
// bucket, the one algorithm that uses it.
func describeOverride(o policy.Override, p policy.Policy) string {
	parts := []string{"limit " + inherit(o.Limit), "window " + inheritDuration(o.Window)}
	if p.Algorithm == ratelimit.TokenBucket || o.Burst != 0 {
		parts = append(parts, "burst "+inherit(o.Burst))
	}
	if o.ExpiresAt.IsZero() {
		parts = append(parts, "never expires")
	} else {
		parts = append(parts, "expires at "+o.ExpiresAt.UTC().Format(time.RFC3339))
	}
	if o.Note != "" {
		parts = append(parts, fmt.Sprintf("note %q", o.Note))
	}
	return strings.Join(parts, ", ")
}

func burstText(b int64) string {
	if b == 0 {
		return "=limit"
	}
	return strconv.FormatInt(b, 10)
}

func inherit(v int64) string {
	if v == 0 {
		return "(policy's)"
	}
	return strconv.FormatInt(v, 10)
}

func inheritDuration(d time.Duration) string {
	if d == 0 {
		return "(policy's)"
	}
	return d.String()
}

func keyModeText(m ratelimit.KeyMode) string {
	if m == ratelimit.ReadableKeys {
		return "readable"
	}
	return "hashed"
}

// keyText shows a readable key as text (without "name:"), a hashed one in
// hexadecimal.
func keyText(o policy.Override, p policy.Policy) string {
	if p.KeyMode == ratelimit.ReadableKeys && strings.HasPrefix(string(o.Key), p.Name+":") {
		return strconv.Quote(string(o.Key)[len(p.Name)+1:])
	}
	return hex.EncodeToString(o.Key)
}

func policyJSON(p policy.Policy) map[string]any {
	var burst any
	if p.Burst != 0 {
		burst = p.Burst
	}
	return map[string]any{
		"name": p.Name, "algorithm": string(p.Algorithm), "limit": p.Limit,
		"window": p.Window.String(), "window_seconds": p.Window.Seconds(), "burst": burst,
		"penalty": p.Penalty, "key_mode": keyModeText(p.KeyMode), "description": p.Description,
		"created_at": p.CreatedAt.UTC().Format(time.RFC3339Nano), "updated_at": p.UpdatedAt.UTC().Format(time.RFC3339Nano),
	}
}

func overrideJSON(o policy.Override, p policy.Policy) map[string]any {
	nz := func(v int64) any {
		if v == 0 {
			return nil
		}
		return v
	}
	var window, expires, key any
	if o.Window != 0 {
		window = o.Window.String()
	}
	if !o.ExpiresAt.IsZero() {
		expires = o.ExpiresAt.UTC().Format(time.RFC3339Nano)
	}
	if p.KeyMode == ratelimit.ReadableKeys && strings.HasPrefix(string(o.Key), p.Name+":") {
		key = string(o.Key)[len(p.Name)+1:]
	}
	return map[string]any{
		"policy": o.Policy, "key_hex": hex.EncodeToString(o.Key), "key": key,
		"limit": nz(o.Limit), "window": window, "burst": nz(o.Burst),
		"expires_at": expires, "expired": !o.Applies(time.Now()), "note": o.Note,
		"created_at": o.CreatedAt.UTC().Format(time.RFC3339Nano), "updated_at": o.UpdatedAt.UTC().Format(time.RFC3339Nano),
	}
}

// policyFile is one policy as apply reads it: the JSON of list. Its last
// three fields are what list prints besides and apply ignores; any other
// field is refused, so that a misspelt one is not silently dropped.
type policyFile struct {
	Name        string `json:"name"`
	Algorithm   string `json:"algorithm"`
	Limit       int64  `json:"limit"`
	Window      string `json:"window"`
	Burst       *int64 `json:"burst"`
	Penalty     bool   `json:"penalty"`
	KeyMode     string `json:"key_mode"`
	Description string `json:"description"`

	WindowSeconds json.RawMessage `json:"window_seconds"`
	CreatedAt     json.RawMessage `json:"created_at"`
	UpdatedAt     json.RawMessage `json:"updated_at"`
}

// policyFields are the fields of a policy in apply's file, and
// ignoredFields those that list prints and apply ignores.
var (
	policyFields  = []string{"name", "algorithm", "limit", "window", "burst", "penalty", "key_mode", "description"}
	ignoredFields = []string{"window_seconds", "created_at", "updated_at"}
)

// unknownField returns the field name of encoding/json's error for a field
// that the target lacks, or "".
func unknownField(err error) string {
	const prefix = `json: unknown field "`
	msg := err.Error()
	if !strings.HasPrefix(msg, prefix) {
		return ""
	}
	return strings.TrimSuffix(strings.TrimPrefix(msg, prefix), `"`)
}

// closest returns the known name nearest to name, when a typo (an edit
// distance of at most 2, or at most 3 with a common start of 4 letters)
// would explain the difference, else "".
func closest(name string, known []string) string {
	best, bestD := "", 3
	name = strings.ToLower(name)
	for _, k := range known {
		d := editDistance(name, k)
		if d == 3 && len(name) >= 4 && len(k) >= 4 && name[:4] == k[:4] {
			d = 2
		}
		if d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// readPolicies reads apply's file (or stdin for "-"). Unknown fields, at the
// top and in each policy, are refused with the known ones.
func readPolicies(path string, stdin io.Reader) ([]policy.Policy, error) {
	var r io.Reader = stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, usagef("apply: %v", err)
		}
		defer f.Close()
		r = f
	}
	var doc struct {
		Command  json.RawMessage    `json:"command"` // printed by list, ignored
		Policies *[]json.RawMessage `json:"policies"`
	}
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		if f := unknownField(err); f != "" {
			hint := ""
			if c := closest(f, []string{"policies"}); c != "" {
				hint = fmt.Sprintf(" (did you mean %q?)", c)
			}
			return nil, usagef("apply: %s has an unknown field %q at the top%s; the file is one object {\"policies\": [...]} (\"command\", which list prints, is ignored)", path, f, hint)
		}
		return nil, usagef("apply: %s is not a JSON object {\"policies\": [...]}: %v", path, err)
	}
	if dec.More() {
		return nil, usagef("apply: %s holds more than one JSON value; put every policy in the one \"policies\" array", path)
	}
	if doc.Policies == nil {
		return nil, usagef("apply: %s has no \"policies\" array; write {\"policies\": []} to mean none", path)
	}
	out := make([]policy.Policy, 0, len(*doc.Policies))
	for i, raw := range *doc.Policies {
		var f policyFile
		pd := json.NewDecoder(bytes.NewReader(raw))
		pd.DisallowUnknownFields()
		if err := pd.Decode(&f); err != nil {
			var name struct {
				Name string `json:"name"`
			}
			_ = json.Unmarshal(raw, &name)
			if field := unknownField(err); field != "" {
				hint := ""
				if c := closest(field, policyFields); c != "" {
					hint = fmt.Sprintf(" (did you mean %q?)", c)
				}
				return nil, usagef("apply: policy %d (%q): unknown field %q%s; a policy's fields are %s (list's %s are ignored)",
					i, name.Name, field, hint, strings.Join(policyFields, ", "), strings.Join(ignoredFields, ", "))
			}
			return nil, usagef("apply: policy %d (%q) is not a policy object: %v", i, name.Name, err)
		}
		w, err := time.ParseDuration(f.Window)
		if err != nil {
			return nil, usagef("apply: policy %d (%q): window %q is not a duration: use a duration such as 90s, 15m or 24h", i, f.Name, f.Window)
		}
		mode, err := policy.ParseKeyMode(f.KeyMode)
		if err != nil {
			return nil, usagef("apply: policy %d (%q): key_mode %q: use hashed or readable", i, f.Name, f.KeyMode)
		}
		p := policy.Policy{Name: f.Name, Algorithm: ratelimit.Algorithm(f.Algorithm), Limit: f.Limit, Window: w,
			Penalty: f.Penalty, KeyMode: mode, Description: f.Description}
		if f.Burst != nil {
			p.Burst = *f.Burst
		}
		out = append(out, p)
	}
	return out, nil
}

// apply plans and, unless dry, makes the changes in one transaction, which
// holds the policy table (SHARE ROW EXCLUSIVE: no other writer, and
// policy.Update waits before it reads) and every policy's row, so that the
// plan stays true until commit.
func (a *app) apply(ctx context.Context, want []policy.Policy, prune, dry bool) error {
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	var changes []policy.Change
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `LOCK TABLE pgrl_policy IN SHARE ROW EXCLUSIVE MODE`); err != nil {
			return err
		}
		// Every row too, before anything is written: an override writer
		// holding a policy's row (policy.SetOverride) finishes first,
		// instead of deadlocking with a key-mode change below, which locks
		// the override table.
		if _, err := tx.Exec(ctx, `SELECT FROM pgrl_policy ORDER BY name FOR UPDATE`); err != nil {
			return err
		}
		stored, err := policy.List(ctx, tx)
		if err != nil {
			return err
		}
		if changes, err = policy.Plan(stored, want, prune); err != nil {
			return err
		}
		if dry {
			return nil
		}
		for _, c := range changes {
			if c.Op == "delete" {
				err = policy.Delete(ctx, tx, c.Name)
			} else {
				_, err = policy.Set(ctx, tx, *c.After)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", c, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	if a.json() {
		out := make([]map[string]any, len(changes))
		for i, c := range changes {
			m := map[string]any{"op": c.Op, "name": c.Name, "before": nil, "after": nil}
			if c.Before != nil {
				m["before"] = policyJSON(*c.Before)
			}
			if c.After != nil {
				m["after"] = policyFileJSON(*c.After)
			}
			out[i] = m
		}
		return cli.PrintJSON(a.stdout, map[string]any{"command": "apply", "dry_run": dry, "changes": out})
	}
	if len(changes) == 0 {
		fmt.Fprintln(a.stdout, "nothing to change: the stored policies are those of the file")
		return nil
	}
	for _, c := range changes {
		fmt.Fprintln(a.stdout, c.String())
	}
	if dry {
		fmt.Fprintf(a.stdout, "dry run: %s, none made\n", plural(len(changes), "change", "changes"))
	} else {
		fmt.Fprintf(a.stdout, "applied %s in one transaction\n", plural(len(changes), "change", "changes"))
	}
	return nil
}

// explainBurst is the burst that applies under a token bucket, and nil
// under the other algorithms, which have none.
func explainBurst(x policy.Explanation) any {
	if x.Policy.Algorithm != ratelimit.TokenBucket {
		return nil
	}
	return x.Rate.Burst
}

// plural is "1 change" or "n changes", "1 row" or "n rows".
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}

// policyFileJSON is policyJSON without the instants a wanted policy lacks.
func policyFileJSON(p policy.Policy) map[string]any {
	m := policyJSON(p)
	delete(m, "created_at")
	delete(m, "updated_at")
	return m
}
