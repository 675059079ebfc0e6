package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// cluster is a throwaway PostgreSQL server of the test's own.
type cluster struct {
	port   int
	binDir string // the server's binaries: initdb, pg_ctl, psql
}

// startCluster initialises and starts a throwaway PostgreSQL on a free port
// of 127.0.0.1 with the given authentication method ("trust",
// "scram-sha-256", ...) and superuser postgres whose password is pw, and
// stops it when the test ends.
func startCluster(t *testing.T, auth, pw string) cluster {
	t.Helper()
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(bins) == 0 {
		if p, err := exec.LookPath("initdb"); err == nil {
			bins = []string{p}
		}
	}
	if len(bins) == 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("CI: no PostgreSQL server binaries (initdb) installed to start a throwaway cluster")
		}
		t.Skip("no PostgreSQL server binaries (initdb) installed to start a throwaway cluster")
	}
	binDir := filepath.Dir(bins[len(bins)-1])
	// Not t.TempDir: its parent is private to this user, and the server
	// runs as postgres.
	dir, err := os.MkdirTemp("", "pgrl-cluster-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o777))
	data := filepath.Join(dir, "data")
	pwfile := filepath.Join(dir, "pw")
	require.NoError(t, os.WriteFile(pwfile, []byte(pw+"\n"), 0o644))

	asPostgres := func(name string, args ...string) *exec.Cmd {
		if u, err := user.Current(); err == nil && u.Uid == "0" {
			return exec.Command("runuser", append([]string{"-u", "postgres", "--", filepath.Join(binDir, name)}, args...)...)
		}
		return exec.Command(filepath.Join(binDir, name), args...)
	}
	out, err := asPostgres("initdb", "-D", data, "-U", "postgres", "--auth="+auth, "--pwfile="+pwfile, "--no-sync").CombinedOutput()
	require.NoError(t, err, "initdb: %s", out)

	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	opts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -k %s -c fsync=off -c shared_buffers=16MB -c max_connections=20", port, dir)
	out, err = asPostgres("pg_ctl", "-D", data, "-o", opts, "-l", filepath.Join(dir, "log"), "-w", "start").CombinedOutput()
	require.NoError(t, err, "pg_ctl start: %s", out)
	t.Cleanup(func() {
		// -w: the server has exited before its directory is removed.
		_ = asPostgres("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop").Run()
	})
	return cluster{port: port, binDir: binDir}
}
