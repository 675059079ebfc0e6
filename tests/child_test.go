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
// stop returns how many it terminated. It terminates no more than perRow
// backends per row of pgrl_request (one per request id or settlement
// made): the calls of these tests wait in line for one hot key's row lock,
// and on a busy machine, where that line moves slowly, terminations at a
// fixed pace end nearly every waiting statement, so that no call finishes.
// Tied to progress, the terminations per call made stay the same whatever
// the machine's speed.
func terminateAtRandom(ctx context.Context, pool *pgxpool.Pool, pattern string, perRow int64) (stop func() int64) {
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
			var made, n int64
			if pool.QueryRow(ctx, "SELECT count(*) FROM pgrl_request").Scan(&made) != nil || killed.Load() >= perRow*made {
				continue
			}
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

// logActivityBefore logs, 10 s before ctx's deadline unless the returned
// stop is called first, what the backends whose application_name is LIKE
// pattern are doing: when a multi-process test runs out of time, its
// children are killed and say nothing more, and this says where they were
// waiting.
func logActivityBefore(t *testing.T, ctx context.Context, pool *pgxpool.Pool, pattern string) (stop func()) {
	deadline, _ := ctx.Deadline()
	logged := make(chan struct{})
	timer := time.AfterFunc(time.Until(deadline)-10*time.Second, func() {
		defer close(logged)
		rows, err := pool.Query(context.Background(), `SELECT application_name, state, coalesce(wait_event_type, ''),
			coalesce(wait_event, ''), now() - query_start, left(regexp_replace(query, '\s+', ' ', 'g'), 100) FROM pg_stat_activity
			WHERE application_name LIKE $1 ORDER BY application_name`, pattern)
		if err != nil {
			t.Logf("pg_stat_activity: %v", err)
			return
		}
		defer rows.Close()
		for rows.Next() {
			var app, state, waitType, wait, query string
			var running time.Duration
			if err := rows.Scan(&app, &state, &waitType, &wait, &running, &query); err == nil {
				t.Logf("running out of time: %s %s %s/%s for %v: %s", app, state, waitType, wait, running, query)
			}
		}
	})
	return func() {
		if !timer.Stop() {
			<-logged // the test does not end while it logs
		}
	}
}
