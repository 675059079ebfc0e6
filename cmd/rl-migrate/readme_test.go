package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// The README's production snippet runs as written on a fresh server whose
// application database is called app: only the host "db" is replaced by the
// throwaway server's address. It creates both roles, migrates as the owner
// with --grant-to app, and the status --check it shows passes as app. The
// application role can then run checks, and nothing else.
func TestREADMEProductionSnippet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	body, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	readme := string(body)
	start := strings.Index(readme, "In production, migrate as a role")
	require.NotEqual(t, -1, start, "the README has the production snippet")
	block := regexp.MustCompile("(?s)```sh\n(.*?)```").FindStringSubmatch(readme[start:])
	require.NotNil(t, block)
	snippet := block[1]
	require.Contains(t, snippet, "CREATE ROLE app ", "the snippet creates the application role")
	require.Contains(t, snippet, "--grant-to app")

	c := startCluster(t, "scram-sha-256", "superpw")
	addr := fmt.Sprintf("127.0.0.1:%d", c.port)
	super := fmt.Sprintf("postgres://postgres:superpw@%s/postgres?sslmode=disable", addr)
	conn, err := pgx.Connect(ctx, super)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "CREATE DATABASE app")
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))

	script := strings.ReplaceAll(snippet, "@db/", "@"+addr+"/")
	require.NotContains(t, script, "@db", "every use of the host was replaced")
	cmd := exec.Command("bash", "-euo", "pipefail", "-c", script)
	// psql connects as the superuser to the application's database, as
	// a DBA would; everything else comes from the snippet.
	cmd.Env = []string{
		"PATH=" + filepath.Dir(binary) + string(os.PathListSeparator) + c.binDir + string(os.PathListSeparator) + os.Getenv("PATH"),
		"HOME=" + os.TempDir(),
		"PGHOST=127.0.0.1", fmt.Sprintf("PGPORT=%d", c.port), "PGUSER=postgres", "PGPASSWORD=superpw", "PGDATABASE=app",
		"PGSSLMODE=disable",
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the README's production snippet:\n%s\noutput:\n%s", script, out)

	// "the application connects as app with search_path=ratelimit"
	pool, err := pgxpool.New(ctx, fmt.Sprintf("postgres://app:...@%s/app?sslmode=disable&search_path=ratelimit", addr))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	// A first connection (SCRAM) outside the checks' Timeout: on a busy
	// machine it took longer than the default Timeout.
	require.NoError(t, pool.Ping(ctx))
	l, err := testkit.New(pool, ratelimit.Config{Name: "readme", Limit: 2, Window: time.Minute, OnFailure: ratelimit.FailError})
	require.NoError(t, err)
	for i, want := range []bool{true, true, false} {
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store)
		require.Equal(t, want, d.Allowed, "check %d", i+1)
	}
	_, err = pool.Exec(ctx, "CREATE TABLE intruder (x int)")
	require.Error(t, err, "the application role runs no DDL")
}
