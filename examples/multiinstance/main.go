// Command multiinstance reproduces, on your machine, the experiment that shows
// why a rate limiter whose counters live in each process's memory leaks once
// an application runs more than one instance, and that pgrl's shared counter
// in PostgreSQL does not.
//
// It starts --processes copies of itself (default 4), each standing in for
// one instance of an application. All of them fire --calls concurrent checks
// (default 50 each) at the same key, at the same moment, against a limit of
// --limit per minute (default 20). It does this twice: first with an
// in-process memory limiter in each process, then with pgrl
// (--algorithm fixed_window, token_bucket or sliding_window). It prints what
// each process admitted:
//
//	go run ./examples/multiinstance
//	go run ./examples/multiinstance --algorithm token_bucket --output json
//
// The database is --database-url, else $DATABASE_URL, else the test database
// ($PGRL_TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/pgrl_test);
// scripts/demo.sh starts that one when it is not running. Whatever the
// database, the demo's tables live in a schema of its own, --schema (default
// pgrl_demo), which it creates and migrates before it starts and names on
// stderr and in its JSON result: it never writes into public or into the
// schema a URL's search_path names, which is likely your application's.
// Every run counts against a fresh key, so repeated runs start from zero.
//
// Exit status: 0 when the demo ran (whatever it admitted), 1 on a runtime
// error, 2 on bad flags.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/ident"
	"github.com/pgrl/pgrl/ratelimit"
)

// envTestURL names the test database (see internal/dbtest), which the demo
// uses when neither --database-url nor DATABASE_URL is set.
const envTestURL = "PGRL_TEST_DATABASE_URL"

// defaultTestURL is the test database when envTestURL is unset.
const defaultTestURL = "postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable"

// DefaultSchema is the schema the demo's tables live in, in whatever
// database it runs, unless --schema names another.
const DefaultSchema = "pgrl_demo"

// defaultURL is the test database.
func defaultURL() string {
	if u := os.Getenv(envTestURL); u != "" {
		return u
	}
	return defaultTestURL
}

// limiterName names the demo's limiter; its counters are scoped by it.
const limiterName = "multiinstance-demo"

// Stores a round can run against.
const (
	storeMemory   = "memory"
	storePostgres = "postgres"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// options are the parsed command line.
type options struct {
	processes   int
	calls       int
	limit       int64
	algorithm   ratelimit.Algorithm
	databaseURL string
	schema      string
	output      string
	key         string
	penalty     bool
	rounds      []string
	conns       int

	child string // hidden: run as a child against this store
}

// hiddenFlags are flags for the parent-child protocol, left out of -help.
var hiddenFlags = map[string]bool{"child": true}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("multiinstance", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.processes, "processes", 4, "OS processes, each standing in for one instance of an application")
	fs.IntVar(&o.calls, "calls", 50, "concurrent checks each process fires at the key")
	fs.Int64Var(&o.limit, "limit", 20, "requests admitted per minute (the token bucket's capacity, with negligible refill)")
	algorithm := fs.String("algorithm", string(ratelimit.FixedWindow), "pgrl algorithm: fixed_window, token_bucket or sliding_window")
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL connection URL; defaults to $DATABASE_URL, else $PGRL_TEST_DATABASE_URL (or the local test database)")
	fs.StringVar(&o.schema, "schema", DefaultSchema, "schema of the demo's own, created when missing, for its tables (the URL's search_path is ignored)")
	fs.StringVar(&o.output, "output", "text", "output format: text or json")
	fs.StringVar(&o.key, "key", "", "the key every call checks; defaults to a fresh random key per run")
	fs.BoolVar(&o.penalty, "penalty", false, "count every attempt, denied ones included (penalty mode)")
	rounds := fs.String("rounds", storeMemory+","+storePostgres, "rounds to run, in order: memory, postgres or both")
	fs.IntVar(&o.conns, "conns", 10, "database connections per process")
	fs.StringVar(&o.child, "child", "", "internal: run as a child process against this store")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: multiinstance [flags]\n\nFires concurrent checks at one key from several processes, first with a\nper-process memory limiter, then with pgrl's shared counter in PostgreSQL.\n\nFlags:\n")
		fs.VisitAll(func(f *flag.Flag) {
			if hiddenFlags[f.Name] {
				return
			}
			fmt.Fprintf(stderr, "  --%s\n    \t%s (default %q)\n", f.Name, f.Usage, f.DefValue)
		})
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	a, err := ratelimit.ParseAlgorithm(*algorithm)
	if err != nil {
		return o, fmt.Errorf("--algorithm: %v", err)
	}
	o.algorithm = a
	switch {
	case o.processes < 1:
		return o, fmt.Errorf("--processes %d: run at least 1 process", o.processes)
	case o.calls < 1:
		return o, fmt.Errorf("--calls %d: fire at least 1 call per process", o.calls)
	case o.limit < 1:
		return o, fmt.Errorf("--limit %d: the limit must be at least 1", o.limit)
	case o.conns < 1:
		return o, fmt.Errorf("--conns %d: use at least 1 connection per process", o.conns)
	case ident.Check("--schema", o.schema) != nil:
		return o, ident.Check("--schema", o.schema)
	case o.output != "text" && o.output != "json":
		return o, fmt.Errorf("--output %q: use text or json", o.output)
	case o.child != "" && o.child != storeMemory && o.child != storePostgres:
		return o, fmt.Errorf("--child %q: use memory or postgres", o.child)
	}
	for _, r := range strings.Split(*rounds, ",") {
		r = strings.TrimSpace(r)
		if r != storeMemory && r != storePostgres {
			return o, fmt.Errorf("--rounds %q: list memory, postgres or both", *rounds)
		}
		o.rounds = append(o.rounds, r)
	}
	return o, nil
}

// run is the whole program; it returns the exit status.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return cli.ExitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "multiinstance: %v\n", err)
		return cli.ExitUsage
	}
	if o.databaseURL == "" {
		o.databaseURL = os.Getenv(cli.EnvDatabaseURL)
	}
	if o.databaseURL == "" {
		o.databaseURL = defaultURL()
	}
	if o.child != "" {
		if err := runChild(ctx, o, stdin, stdout); err != nil {
			fmt.Fprintf(stderr, "multiinstance child: %s\n", cli.Explain(err))
			return cli.ExitError
		}
		return cli.ExitOK
	}
	res, err := runParent(ctx, o, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "multiinstance: %s\n", cli.Explain(err))
		return cli.ExitError
	}
	if o.output == "json" {
		err = cli.PrintJSON(stdout, res)
	} else {
		err = printTable(stdout, res)
	}
	if err != nil {
		fmt.Fprintf(stderr, "multiinstance: %v\n", err)
		return cli.ExitError
	}
	return cli.ExitOK
}

// limiterConfig is the limit every process applies, in memory and in
// PostgreSQL alike.
func limiterConfig(o options) ratelimit.Config {
	cfg := ratelimit.Config{
		Name:      limiterName,
		Algorithm: o.algorithm,
		Limit:     o.limit,
		Window:    time.Minute,
		Penalty:   o.penalty,
	}
	if o.algorithm == ratelimit.TokenBucket {
		// Capacity = limit, refilled by Limit tokens a day: during the demo
		// the refill adds well under one token.
		cfg.Window = 24 * time.Hour
		cfg.Burst = o.limit
	}
	return cfg
}

// demoTimeout is how long a check of the postgres round waits for
// PostgreSQL before the failure policy answers it.
const demoTimeout = 30 * time.Second

// Result is what the demo prints with --output json.
type Result struct {
	// Algorithm is pgrl's algorithm in the postgres round.
	Algorithm ratelimit.Algorithm `json:"algorithm"`
	// Limit is the limit every process applies.
	Limit int64 `json:"limit"`
	// Window is the limit's window (the token bucket's refill period).
	Window string `json:"window"`
	// Penalty reports penalty mode: denied attempts were counted too.
	Penalty bool `json:"penalty"`
	// Processes is how many OS processes took part.
	Processes int `json:"processes"`
	// CallsPerProcess is how many concurrent calls each process fired.
	CallsPerProcess int `json:"calls_per_process"`
	// Schema is the schema that holds the demo's tables.
	Schema string `json:"schema"`
	// LimiterName and Key identify the counter all the calls shared.
	LimiterName string `json:"limiter_name"`
	Key         string `json:"key"`
	// MemoryAdmitted is the total admitted by the per-process memory
	// limiters; MemoryPerProcess splits it by process. Both are absent when
	// the memory round was not run.
	MemoryAdmitted   *int  `json:"memory_admitted,omitempty"`
	MemoryPerProcess []int `json:"memory_per_process,omitempty"`
	// PostgresAdmitted is the total admitted by pgrl's shared counter;
	// PostgresPerProcess splits it by process. Both are absent when the
	// postgres round was not run.
	PostgresAdmitted   *int  `json:"postgres_admitted,omitempty"`
	PostgresPerProcess []int `json:"postgres_per_process,omitempty"`
	// PostgresFallback counts the checks of the postgres round that
	// PostgreSQL did not answer within the limiter's Timeout, answered by
	// the failure policy instead (each process's memory tier): 0 when the
	// shared counter decided every check. Absent when the postgres round
	// was not run.
	PostgresFallback *int `json:"postgres_fallback,omitempty"`
}

func runParent(ctx context.Context, o options, stderr io.Writer) (Result, error) {
	if o.key == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		o.key = "user:demo:" + hex.EncodeToString(b[:])
	}
	cfg := limiterConfig(o)
	res := Result{
		Algorithm:       o.algorithm,
		Limit:           o.limit,
		Window:          cfg.Window.String(),
		Penalty:         o.penalty,
		Processes:       o.processes,
		CallsPerProcess: o.calls,
		Schema:          o.schema,
		LimiterName:     limiterName,
		Key:             o.key,
	}
	for _, round := range o.rounds {
		if round == storePostgres {
			if err := prepareDatabase(ctx, o.databaseURL, o.schema, stderr); err != nil {
				return res, err
			}
			if o.algorithm != ratelimit.TokenBucket {
				if err := awaitWindowRoom(ctx, o.databaseURL, cfg.Window, stderr); err != nil {
					return res, err
				}
			}
		}
		per, fallback, err := runRound(ctx, o, round, stderr)
		if err != nil {
			return res, fmt.Errorf("%s round: %w", round, err)
		}
		total := 0
		for _, n := range per {
			total += n
		}
		if round == storeMemory {
			res.MemoryAdmitted, res.MemoryPerProcess = &total, per
		} else {
			res.PostgresAdmitted, res.PostgresPerProcess = &total, per
			res.PostgresFallback = &fallback
		}
	}
	return res, nil
}

// childReport is what a child writes to its stdout when its calls are done.
type childReport struct {
	Admitted int `json:"admitted"`
	Denied   int `json:"denied"`
	Errors   int `json:"errors"`
	// Fallback counts the decisions not made by PostgreSQL (the failure
	// policy's memory tier answered them).
	Fallback int    `json:"fallback"`
	Error    string `json:"error,omitempty"`
}

// The parent-child protocol, one line each over the child's stdout and
// stdin: the child sets up its limiter (and connections) and writes
// readyLine; once every child is ready the parent writes goLine to all of
// them, so that they fire at the same moment; each child then writes one
// childReport as JSON and exits.
const (
	readyLine = "ready"
	goLine    = "go"
)

// child is one running child process.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
}

// runRound runs one round: every child fires its calls against store, and
// the admitted count of each is returned, with how many checks in all the
// failure policy answered.
func runRound(ctx context.Context, o options, store string, stderr io.Writer) ([]int, int, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, 0, fmt.Errorf("find own executable: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	args := []string{
		"--child", store,
		"--algorithm", string(o.algorithm),
		"--limit", strconv.FormatInt(o.limit, 10),
		"--calls", strconv.Itoa(o.calls),
		"--conns", strconv.Itoa(o.conns),
		"--key", o.key,
		"--penalty=" + strconv.FormatBool(o.penalty),
		"--database-url", o.databaseURL,
		"--schema", o.schema,
	}
	// Children's messages go to our stderr; when that is not a file, the
	// copies run concurrently and must take turns.
	if _, isFile := stderr.(*os.File); !isFile {
		stderr = &lockedWriter{w: stderr}
	}
	children := make([]*child, 0, o.processes)
	defer func() {
		for _, c := range children {
			_ = c.stdin.Close()
			_ = c.cmd.Wait()
		}
	}()
	for range o.processes {
		cmd := exec.CommandContext(ctx, exe, args...)
		cmd.Stderr = stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return nil, 0, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, 0, err
		}
		if err := cmd.Start(); err != nil {
			return nil, 0, fmt.Errorf("start child: %w", err)
		}
		children = append(children, &child{cmd: cmd, stdin: in, stdout: bufio.NewReader(out)})
	}
	// Start barrier: wait until every child is ready, then release all.
	for i, c := range children {
		line, err := c.stdout.ReadString('\n')
		if strings.TrimSpace(line) != readyLine {
			return nil, 0, fmt.Errorf("child %d did not get ready (%q, %v); see its message above", i+1, line, err)
		}
	}
	for _, c := range children {
		if _, err := io.WriteString(c.stdin, goLine+"\n"); err != nil {
			return nil, 0, fmt.Errorf("release child: %w", err)
		}
	}
	admitted, fallback := make([]int, len(children)), 0
	for i, c := range children {
		var rep childReport
		if err := json.NewDecoder(c.stdout).Decode(&rep); err != nil {
			return nil, 0, fmt.Errorf("child %d: no report (%v); see its message above", i+1, err)
		}
		if rep.Errors > 0 {
			return nil, 0, fmt.Errorf("child %d: %d of %d calls failed: %s", i+1, rep.Errors, o.calls, rep.Error)
		}
		admitted[i] = rep.Admitted
		fallback += rep.Fallback
	}
	return admitted, fallback, nil
}

// runChild is one process of a round.
func runChild(ctx context.Context, o options, stdin io.Reader, stdout io.Writer) error {
	cfg := limiterConfig(o)
	var lim ratelimit.Checker
	switch o.child {
	case storeMemory:
		m, err := newMemoryLimiter(cfg)
		if err != nil {
			return err
		}
		lim = m
	default:
		pool, err := openPool(ctx, o.databaseURL, o.schema, o.conns)
		if err != nil {
			return err
		}
		defer pool.Close()
		// The demo measures the shared count, so it lets a check wait
		// for PostgreSQL longer than the default (DefaultTimeout): on a
		// busy machine 200 simultaneous checks of one key can queue past
		// it, and a check that waits longer is answered by the failure
		// policy (each process's memory tier), which counts per process.
		// Such answers are reported as postgres_fallback.
		limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Timeout: demoTimeout})
		if err != nil {
			return err
		}
		l, err := limits.Limiter(cfg)
		if err != nil {
			return err
		}
		lim = l
	}
	if _, err := io.WriteString(stdout, readyLine+"\n"); err != nil {
		return err
	}
	line, err := bufio.NewReader(stdin).ReadString('\n')
	if strings.TrimSpace(line) != goLine {
		return fmt.Errorf("no start signal from the parent (%q, %v)", line, err)
	}

	callCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var (
		mu   sync.Mutex
		rep  childReport
		wg   sync.WaitGroup
		fire = make(chan struct{})
	)
	for range o.calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-fire
			d, err := lim.Allow(callCtx, o.key)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && d.Store == ratelimit.StoreMemory && o.child != storeMemory:
				rep.Fallback++
				if d.Allowed {
					rep.Admitted++
				} else {
					rep.Denied++
				}
			case err != nil:
				rep.Errors++
				if rep.Error == "" {
					rep.Error = cli.Explain(err)
				}
			case d.Allowed:
				rep.Admitted++
			default:
				rep.Denied++
			}
		}()
	}
	close(fire)
	wg.Wait()
	return cli.PrintJSON(stdout, rep)
}

func printTable(w io.Writer, r Result) error {
	how := fmt.Sprintf("%s, window %s", r.Algorithm, r.Window)
	if r.Algorithm == ratelimit.TokenBucket {
		how = fmt.Sprintf("%s: capacity %d, refilled %d per %s", r.Algorithm, r.Limit, r.Limit, r.Window)
	}
	if r.Penalty {
		how += ", penalty mode"
	}
	fmt.Fprintf(w, "%d processes × %d concurrent calls on one key, limit %d (%s)\n\n",
		r.Processes, r.CallsPerProcess, r.Limit, how)
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "process\tin-memory limiter\tpgrl (PostgreSQL)\t")
	cell := func(per []int, i int) string {
		if per == nil {
			return "-"
		}
		return strconv.Itoa(per[i])
	}
	for i := range r.Processes {
		fmt.Fprintf(tw, "%d\t%s\t%s\t\n", i+1, cell(r.MemoryPerProcess, i), cell(r.PostgresPerProcess, i))
	}
	total := func(p *int) string {
		if p == nil {
			return "-"
		}
		return strconv.Itoa(*p)
	}
	fmt.Fprintf(tw, "admitted\t%s\t%s\t\n", total(r.MemoryAdmitted), total(r.PostgresAdmitted))
	fmt.Fprintf(tw, "limit\t%d\t%d\t\n", r.Limit, r.Limit)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	calls := r.Processes * r.CallsPerProcess
	if r.MemoryAdmitted != nil {
		fmt.Fprintf(w, "In memory, every process keeps its own counter: %d of %d calls got through a limit of %d.\n", *r.MemoryAdmitted, calls, r.Limit)
	}
	if r.PostgresAdmitted != nil {
		fmt.Fprintf(w, "With one shared counter in PostgreSQL: %d of %d.\n", *r.PostgresAdmitted, calls)
		if r.PostgresFallback != nil && *r.PostgresFallback > 0 {
			fmt.Fprintf(w, "PostgreSQL did not answer %d checks within %s: each process's memory tier answered them (the failure policy), counting per process.\n", *r.PostgresFallback, demoTimeout)
		}
	}
	return nil
}

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
