package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// child is another OS process running one test function of this test
// binary: it prints "ready", then answers each line written to its stdin
// with one line of JSON.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *bufio.Scanner
	stderr *strings.Builder
}

// startChild runs the test function named test of this binary as another
// OS process, with env added to its environment, and waits for its
// "ready". The process ends with the test (its stdin is closed).
func startChild(t *testing.T, ctx context.Context, test string, env ...string) *child {
	t.Helper()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+test+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), env...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	c := &child{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout), stderr: &strings.Builder{}}
	cmd.Stderr = c.stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = stdin.Close(); _ = cmd.Wait() })
	for c.out.Scan() && c.out.Text() != "ready" {
	}
	require.Equal(t, "ready", c.out.Text(), "%s: %s", test, c.stderr.String())
	return c
}

// send writes one command line.
func (c *child) send(t *testing.T, line string) {
	t.Helper()
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		// The child is gone: what it printed last says why.
		var last []string
		for c.out.Scan() {
			last = append(last, c.out.Text())
		}
		t.Fatalf("child: %v; its last output:\n%s\n%s", err, strings.Join(last[max(0, len(last)-40):], "\n"), c.stderr.String())
	}
}

// read decodes the next answer into v.
func (c *child) read(t *testing.T, v any) {
	t.Helper()
	require.True(t, c.out.Scan(), "child: %s", c.stderr.String())
	require.NoError(t, json.Unmarshal(c.out.Bytes(), v), c.out.Text())
}

// ask sends one command line and decodes its answer into v.
func (c *child) ask(t *testing.T, line string, v any) {
	t.Helper()
	c.send(t, line)
	c.read(t, v)
}

// terminateAtRandom terminates, every 5 to 25 ms, one active backend whose
// application_name is LIKE pattern, until the returned stop is called;
// stop returns how many it terminated.
func terminateAtRandom(ctx context.Context, pool *pgxpool.Pool, pattern string) (stop func() int64) {
	done := make(chan struct{})
	finished := make(chan struct{})
	var killed atomic.Int64
	go func() {
		defer close(finished)
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Duration(5+rand.IntN(20)) * time.Millisecond):
			}
			var n int64
			err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name LIKE $1 AND state = 'active' ORDER BY random() LIMIT 1) AS t`, pattern).Scan(&n)
			if err == nil {
				killed.Add(n)
			}
		}
	}()
	return func() int64 {
		close(done)
		<-finished
		return killed.Load()
	}
}
