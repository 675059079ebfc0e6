package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
)

// A --schema over 63 bytes is a usage error: PostgreSQL would cut it and
// clean another schema.
func TestSchemaOver63BytesIsUsageError(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"--database-url", dbtest.URL(), "--schema", strings.Repeat("s", 64)}, &stdout, &stderr)
	require.Equal(t, cli.ExitUsage, code, stderr.String())
	require.Contains(t, stderr.String(), "63 bytes")
}
