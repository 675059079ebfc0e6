package main

import (
	"bytes"
	"context"
	"testing"
)

// Bad flags are refused with exit status 2 and a message, before anything
// connects.
func TestBadFlagsRefused(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"--database-url", "postgres://x", "--callers", "0"},
		{"--database-url", "postgres://x", "--callers", "-1"},
		{"--database-url", "postgres://x", "--callers", "eight"},
		{"--database-url", "postgres://x", "--callers", ","},
		{"--database-url", "postgres://x", "--keys", "0"},
		{"--database-url", "postgres://x", "--duration", "-1s"},
		{"--database-url", "postgres://x", "--duration", "0"},
		{"--no-such-flag"},
	} {
		var out, errOut bytes.Buffer
		if code := run(context.Background(), args, &out, &errOut); code != 2 {
			t.Errorf("%q: exit %d, want 2 (stderr %q)", args, code, errOut.String())
		}
		if errOut.Len() == 0 {
			t.Errorf("%q: no message", args)
		}
	}
}
