package tests

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// This file holds the fault-injection helpers: a throwaway PostgreSQL
// cluster that a test may stop, crash and restart, and a TCP proxy that a
// test may cut, close or stall. Neither ever touches the server the rest of
// the suite shares.

// pgBinDirEnv names the variable that chooses the PostgreSQL binaries of
// the throwaway clusters: a directory holding initdb, pg_ctl and postgres,
// such as the one `bash scripts/pg.sh MAJOR bindir` prints.
const pgBinDirEnv = "PGRL_TEST_PG_BINDIR"

// pgBinDir returns the bin directory named by PGRL_TEST_PG_BINDIR, else the
// newest PostgreSQL installed under /usr/lib/postgresql, else "".
func pgBinDir() string {
	if d := os.Getenv(pgBinDirEnv); d != "" {
		return d
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	best, bestV := "", -1
	for _, d := range dirs {
		v, err := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(d))))
		if err == nil && v > bestV {
			best, bestV = filepath.Dir(d), v
		}
	}
	return best
}

// freePort asks the kernel for a free TCP port on the loopback interface.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	return port
}

// cluster is a throwaway PostgreSQL cluster of the test's own, on its own
// port and socket directory, run as the postgres user.
type cluster struct {
	t    testing.TB
	bin  string
	dir  string // data directory; also holds the socket and the log
	port int
}

// skipUnlessClusterPossible skips the test when a throwaway cluster cannot
// be made here (not root, no postgres user, no PostgreSQL binaries). CI runs
// as root with PostgreSQL installed, so there the fault tests do run; under
// CI (CI set in the environment) a missing prerequisite fails the test
// instead, so that a skip is never counted as a pass.
func skipUnlessClusterPossible(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		skipOutsideCI(t, "fault tests start a throwaway PostgreSQL cluster as the postgres user through runuser, which needs root; run them as root (CI does)")
	}
	if _, err := user.Lookup("postgres"); err != nil {
		skipOutsideCI(t, "fault tests need the postgres system user (install PostgreSQL's server package)")
	}
	bin := pgBinDir()
	if bin == "" {
		skipOutsideCI(t, "fault tests need initdb and pg_ctl under /usr/lib/postgresql/<version>/bin (install PostgreSQL's server package), or "+pgBinDirEnv+" set to a directory holding them")
	}
	if _, err := os.Stat(filepath.Join(bin, "initdb")); err != nil {
		// A directory named explicitly must be right: fail, never skip.
		t.Fatalf("%s=%s: no initdb there (bash scripts/pg.sh MAJOR bindir prints a directory that has one)", pgBinDirEnv, bin)
	}
	if _, err := exec.LookPath("runuser"); err != nil {
		skipOutsideCI(t, "fault tests need runuser (util-linux)")
	}
	return bin
}

// skipOutsideCI skips the test with reason, except under CI, where every
// prerequisite is installed by .ci/run and a missing one is a failure.
func skipOutsideCI(t testing.TB, reason string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal("CI: " + reason)
	}
	t.Skip(reason)
}

// asPostgres runs a command as the postgres user and fails the test when it
// fails.
func asPostgres(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := asPostgresErr(name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func asPostgresErr(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// chownPostgres gives path to the postgres user.
func chownPostgres(t testing.TB, path string) {
	t.Helper()
	u, err := user.Lookup("postgres")
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(path, uid, gid); err != nil {
		t.Fatal(err)
	}
}

// newCluster initialises and starts a throwaway cluster, migrated in its
// postgres database, and removes it when the test ends.
func newCluster(t testing.TB) *cluster {
	t.Helper()
	bin := skipUnlessClusterPossible(t)
	dir, err := os.MkdirTemp("", "pgrl-fault-")
	if err != nil {
		t.Fatal(err)
	}
	chownPostgres(t, dir)
	c := &cluster{t: t, bin: bin, dir: dir, port: freePort(t)}
	t.Cleanup(func() {
		_, _ = asPostgresErr(filepath.Join(bin, "pg_ctl"), "-D", dir, "-m", "immediate", "-w", "stop")
		_ = os.RemoveAll(dir)
	})
	start := time.Now()
	asPostgres(t, filepath.Join(bin, "initdb"), "-D", dir, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "-N")
	c.start()
	t.Logf("throwaway cluster (%s) on port %d ready in %v", bin, c.port, time.Since(start).Round(time.Millisecond))
	migrateURL(t, c.url())
	return c
}

// options are the server options the cluster starts with: loopback only,
// the socket in the data directory, and no fsync (the machine does not
// crash in these tests; PostgreSQL does).
func (c *cluster) options() string {
	return fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -k %s -c fsync=off -c max_connections=60 -c shared_buffers=16MB", c.port, c.dir)
}

// url is the connection string of the cluster's postgres database.
func (c *cluster) url() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}

// start starts the server and waits until it accepts connections.
func (c *cluster) start() {
	c.t.Helper()
	asPostgres(c.t, filepath.Join(c.bin, "pg_ctl"), "-D", c.dir, "-o", c.options(), "-l", filepath.Join(c.dir, "server.log"), "-w", "-t", "60", "start")
}

// stop shuts the server down with the given mode: "fast" (disconnects
// clients, clean shutdown) or "immediate" (a crash: no shutdown checkpoint,
// crash recovery at the next start, UNLOGGED tables truncated).
func (c *cluster) stop(mode string) {
	c.t.Helper()
	asPostgres(c.t, filepath.Join(c.bin, "pg_ctl"), "-D", c.dir, "-m", mode, "-w", "-t", "60", "stop")
}

// standby makes a streaming-replication standby of c with pg_basebackup -R
// and starts it on a port of its own. It is removed when the test ends.
func (c *cluster) standby() *cluster {
	c.t.Helper()
	t := c.t
	if _, err := os.Stat(filepath.Join(c.bin, "pg_basebackup")); err != nil {
		// The server-only builds scripts/pg.sh fetches have no
		// pg_basebackup.
		skipOutsideCI(t, "a standby needs pg_basebackup, which "+c.bin+" lacks")
	}
	dir, err := os.MkdirTemp("", "pgrl-standby-")
	if err != nil {
		t.Fatal(err)
	}
	chownPostgres(t, dir)
	s := &cluster{t: t, bin: c.bin, dir: dir, port: freePort(t)}
	t.Cleanup(func() {
		_, _ = asPostgresErr(filepath.Join(s.bin, "pg_ctl"), "-D", dir, "-m", "immediate", "-w", "stop")
		_ = os.RemoveAll(dir)
	})
	asPostgres(t, filepath.Join(c.bin, "pg_basebackup"), "-h", "127.0.0.1", "-p", strconv.Itoa(c.port), "-U", "postgres",
		"-D", dir, "-R", "-X", "stream", "--no-sync")
	s.start()
	return s
}

// migrateURL applies every embedded up migration to the database at url,
// in one transaction, in its default schema.
func migrateURL(t testing.TB, url string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	defer conn.Close(ctx)
	if err := dbtest.Apply(ctx, conn, ""); err != nil {
		t.Fatal(err)
	}
}

// tcpProxy forwards connections from a loopback port to a target address,
// and can cut every connection, refuse new ones, or stall (accept and hold
// connections, forwarding nothing, as a network partition or a frozen
// server would).
type tcpProxy struct {
	ln     net.Listener
	target string

	refuse atomic.Bool
	stall  atomic.Bool
	closed atomic.Bool

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup

	// bytesUp counts bytes forwarded from clients to the target.
	bytesUp atomic.Int64
	// accepted counts connections accepted.
	accepted atomic.Int64
}

// newProxy starts a proxy to target; it is closed when the test ends.
func newProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.acceptLoop()
	t.Cleanup(p.close)
	return p
}

// port is the proxy's listening port.
func (p *tcpProxy) port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *tcpProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		_ = c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *tcpProxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

func (p *tcpProxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		if p.refuse.Load() {
			_ = c.Close()
			continue
		}
		if !p.track(c) {
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *tcpProxy) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.untrack(client)
	// A stalled proxy holds new connections without dialling the target.
	for p.stall.Load() {
		if p.closed.Load() || !p.isTracked(client) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		return
	}
	if !p.track(server) {
		return
	}
	defer p.untrack(server)
	done := make(chan struct{}, 2)
	go func() { p.pipe(server, client, &p.bytesUp); done <- struct{}{} }()
	go func() { p.pipe(client, server, nil); done <- struct{}{} }()
	<-done
	// One side ended: end both, so the other copy returns too.
	_ = client.Close()
	_ = server.Close()
	<-done
}

func (p *tcpProxy) isTracked(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.conns[c]
	return ok
}

// pipe copies src to dst, holding data back while the proxy is stalled.
func (p *tcpProxy) pipe(dst, src net.Conn, counter *atomic.Int64) {
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			for p.stall.Load() && !p.closed.Load() && p.isTracked(src) {
				time.Sleep(5 * time.Millisecond)
			}
			if counter != nil {
				counter.Add(int64(n))
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return
			}
			return
		}
	}
}

// cut closes every open connection, both ways, as a network failure or a
// restarted server would.
func (p *tcpProxy) cut() {
	p.mu.Lock()
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
	p.mu.Unlock()
}

// close stops the proxy and waits for its goroutines.
func (p *tcpProxy) close() {
	if p.closed.Swap(true) {
		return
	}
	_ = p.ln.Close()
	p.cut()
	p.wg.Wait()
}

// countingDB is a ratelimit.DB that counts the statements it passes on and
// records when each was sent.
type countingDB struct {
	db ratelimit.DB

	mu    sync.Mutex
	sends []time.Time
}

func (c *countingDB) record() {
	c.mu.Lock()
	c.sends = append(c.sends, time.Now())
	c.mu.Unlock()
}

// Exec counts and delegates.
func (c *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.record()
	return c.db.Exec(ctx, sql, args...)
}

// Query counts and delegates.
func (c *countingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.record()
	return c.db.Query(ctx, sql, args...)
}

// QueryRow counts and delegates.
func (c *countingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c.record()
	return c.db.QueryRow(ctx, sql, args...)
}

// sent returns the instants statements were sent at.
func (c *countingDB) sent() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Time(nil), c.sends...)
}
