package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Main runs a command's run function with a context that ends on SIGINT or
// SIGTERM, then exits with the status it returns.
func Main(run func(ctx context.Context, args []string, stdout, stderr io.Writer) int) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// SplitList splits a comma-separated flag value, trimming spaces and
// dropping empty items.
func SplitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// PositiveInts parses a comma-separated flag value of positive integers;
// name is the flag, for the error message.
func PositiveInts(name, s string) ([]int, error) {
	var out []int
	for _, p := range SplitList(s) {
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

// OpenPool opens a pool of exactly n connections with cfg and establishes
// all of them before it returns, so that a benchmark measures no connection
// setup.
func OpenPool(ctx context.Context, cfg *pgxpool.Config, n int) (*pgxpool.Pool, error) {
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

// RunChart is the whole of a command that reads a JSON report of type R (the
// file named by its one argument, else stdin) and writes the SVG that draw
// makes of it (to the file given with -o, else stdout). cases counts the
// report's cases: a report without any is refused. It returns the exit
// status.
func RunChart[R any](name string, args []string, stdin io.Reader, stdout, stderr io.Writer, cases func(R) int, draw func(R) string) int {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("o", "", "write the SVG to this file instead of stdout")
	if err := fs.Parse(args); err != nil {
		return ExitUsage
	}
	if fs.NArg() > 1 {
		fmt.Fprintf(stderr, "%s: give at most one report file\n", name)
		return ExitUsage
	}
	in := stdin
	if fs.NArg() == 1 {
		f, err := os.Open(fs.Arg(0))
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", name, err)
			return ExitError
		}
		defer f.Close()
		in = f
	}
	var rep R
	if err := json.NewDecoder(in).Decode(&rep); err != nil {
		fmt.Fprintf(stderr, "%s: not a JSON report: %v\n", name, err)
		return ExitError
	}
	if cases(rep) == 0 {
		fmt.Fprintf(stderr, "%s: the report has no cases\n", name)
		return ExitError
	}
	svg := draw(rep)
	if *out == "" {
		if _, err := io.WriteString(stdout, svg); err != nil {
			return ExitError
		}
		return ExitOK
	}
	if err := os.WriteFile(*out, []byte(svg), 0o644); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return ExitError
	}
	return ExitOK
}

// Positional parses fs's flags wherever they stand among args (before,
// between or after the positional arguments, as `rl-migrate layout
// partitioned --partition-width 1h` puts them) and returns the positional
// arguments in order. The error is fs.Parse's.
func Positional(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}
