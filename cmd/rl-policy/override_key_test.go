package main

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// override set refuses a readable key longer than a check takes, given as
// KEY or as --stored-key, with a message that says why; the longest one is
// set.
func TestOverrideSetReadableKeyTooLong(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	name := "l" + strings.Repeat("n", 127)
	_, stderr, code := runFn(t, db(s, "set", name, "--limit", "2", "--window", "1h", "--key-mode", "readable")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	tooLong := strings.Repeat("k", ratelimit.MaxReadableKeyBytes+1)
	for _, args := range [][]string{
		{"override", "set", name, tooLong, "--limit", "5"},
		{"override", "set", name, "--stored-key", hex.EncodeToString([]byte(name + ":" + tooLong)), "--limit", "5"},
	} {
		_, stderr, code = runFn(t, db(s, args...)...)
		require.Equal(t, cli.ExitUsage, code, stderr)
		require.Contains(t, stderr, "a check refuses keys of more than 2048 bytes, so it would never apply")
		require.NotContains(t, stderr, "not a stored key")
	}
	stdout, _, code := runFn(t, jsonDB(s, "override", "list", name)...)
	require.Equal(t, cli.ExitOK, code)
	require.Empty(t, oneJSON(t, stdout)["overrides"])

	_, stderr, code = runFn(t, db(s, "override", "set", name, tooLong[1:], "--limit", "5")...)
	require.Equal(t, cli.ExitOK, code, stderr)
}
