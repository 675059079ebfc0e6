package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

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
	_, err := io.WriteString(c.stdin, line+"\n")
	require.NoError(t, err)
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
