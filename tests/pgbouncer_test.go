package tests

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// bouncer is a PgBouncer in transaction pooling mode in front of a
// database of its own on the shared server.
type bouncer struct {
	port   int
	dbName string
}

// startBouncer creates a database on the shared server, migrates its
// public schema (no search_path is needed, and PgBouncer could not keep one
// in transaction mode), and starts PgBouncer in front of it with
// pool_mode=transaction and fewer server connections than the test's
// clients, so that clients really share server connections between
// transactions. Everything is stopped and dropped when the test ends.
func startBouncer(t *testing.T) *bouncer {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr == nil {
			bin = "/usr/sbin/pgbouncer"
		} else {
			skipOutsideCI(t, "pgbouncer is not installed (apt-get install pgbouncer; the CI script installs it)")
		}
	}
	asRoot := os.Geteuid() == 0
	if asRoot {
		skipUnlessClusterPossible(t) // runuser and the postgres user: PgBouncer refuses to run as root
	}

	target, err := pgconn.ParseConfig(dbtest.URL())
	require.NoError(t, err)
	var rb [5]byte
	_, _ = crand.Read(rb[:])
	b := &bouncer{port: freePort(t), dbName: "pgrl_bouncer_" + hex.EncodeToString(rb[:])}
	admin := dbtest.Admin(t)
	ctx := context.Background()
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{b.dbName}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{b.dbName}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", b.dbName, err)
		}
	})
	direct := strings.Replace(dbtest.URL(), "/"+target.Database, "/"+b.dbName, 1)
	migrateURL(t, direct)

	dir, err := os.MkdirTemp("", "pgrl-bouncer-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	user := target.User
	ini := fmt.Sprintf(`[databases]
bouncer = host=%s port=%d dbname=%s user=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = 3
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,search_path
logfile = %s
pidfile = %s
admin_users = %s
`, target.Host, target.Port, b.dbName, user, b.port, filepath.Join(dir, "userlist.txt"),
		filepath.Join(dir, "pgbouncer.log"), filepath.Join(dir, "pgbouncer.pid"), user)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "userlist.txt"), []byte(fmt.Sprintf("%q \"\"\n", user)), 0o644))
	args := []string{"-d", filepath.Join(dir, "pgbouncer.ini")}
	var cmd *exec.Cmd
	if asRoot {
		for _, f := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "userlist.txt")} {
			chownPostgres(t, f)
		}
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", bin}, args...)...)
	} else {
		cmd = exec.Command(bin, args...)
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "start pgbouncer: %s", out)
	pidFile := filepath.Join(dir, "pgbouncer.pid")
	t.Cleanup(func() {
		body, err := os.ReadFile(pidFile)
		if err != nil {
			return
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(body))); err == nil {
			_ = syscall.Kill(pid, syscall.SIGTERM)
			for range 100 {
				if syscall.Kill(pid, 0) != nil {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	})
	ready := settle(func() bool {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", b.port), time.Second)
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	})
	if !ready {
		log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
		t.Fatalf("pgbouncer did not start listening:\n%s", log)
	}
	version, _ := exec.Command(bin, "--version").Output()
	t.Logf("%s in transaction mode on port %d, in front of database %s", strings.SplitN(string(version), "\n", 2)[0], b.port, b.dbName)
	return b
}

// pool returns a pool through PgBouncer in the given exec mode, with more
// client connections than PgBouncer has server connections.
func (b *bouncer) pool(t *testing.T, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://postgres@127.0.0.1:%d/bouncer?sslmode=disable", b.port))
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// bouncerModes are the pgx exec modes that work through PgBouncer in
// transaction mode without prepared statement support (PgBouncer < 1.21,
// or max_prepared_statements = 0): neither keeps a named prepared
// statement on a server connection across transactions.
var bouncerModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

// TestBouncerTransactionModeSuite runs the algorithm suite through
// PgBouncer in transaction pooling mode, in each usable exec mode:
// random sequences with a pinned clock for every algorithm, with and
// without penalty, decided identically through PgBouncer and directly (the
// direct path is itself checked against the reference model in package
// ratelimit); exactly the limit admitted under concurrency; Peek and Reset;
// and multi-limit decisions, all-or-nothing and consume-all.
func TestBouncerTransactionModeSuite(t *testing.T) {
	b := startBouncer(t)
	for _, m := range bouncerModes {
		t.Run(m.name, func(t *testing.T) {
			via := b.pool(t, m.mode)
			direct, _ := dbtest.Pool(t)
			ctx := context.Background()

			t.Run("sequences", func(t *testing.T) {
				for _, alg := range ratelimit.Algorithms {
					for _, penalty := range []bool{false, true} {
						bouncerSequence(t, via, direct, m.name, alg, penalty)
					}
				}
			})

			t.Run("exact_under_concurrency", func(t *testing.T) {
				for _, alg := range ratelimit.Algorithms {
					l, err := testkit.New(via, ratelimit.Config{Name: "conc-" + m.name + string(alg), Algorithm: alg, Limit: 20, Window: time.Hour, DenyCacheSize: -1}, ratelimit.DatabaseOptions{Timeout: exactTimeout})
					require.NoError(t, err)
					var admitted atomic.Int64
					var wg sync.WaitGroup
					for range 8 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							for range 10 {
								d, err := l.Allow(ctx, "k")
								if err != nil {
									t.Error(err)
									return
								}
								if d.Store != ratelimit.StorePostgres {
									t.Errorf("answered by %s: %s", d.Store, d.Reason)
									return
								}
								if d.Allowed {
									admitted.Add(1)
								}
							}
						}()
					}
					wg.Wait()
					require.Equal(t, int64(20), admitted.Load(), "%s: exactly the limit", alg)
				}
			})

			t.Run("peek_reset", func(t *testing.T) {
				for _, alg := range ratelimit.Algorithms {
					l, err := testkit.New(via, ratelimit.Config{Name: "pr-" + m.name + string(alg), Algorithm: alg, Limit: 3, Window: time.Hour}, ratelimit.DatabaseOptions{Timeout: exactTimeout})
					require.NoError(t, err)
					for range 3 {
						_, err := l.Allow(ctx, "k")
						require.NoError(t, err)
					}
					d, err := l.Peek(ctx, "k")
					require.NoError(t, err)
					require.False(t, d.Allowed)
					require.NoError(t, l.Reset(ctx, "k"))
					d, err = l.Allow(ctx, "k")
					require.NoError(t, err)
					require.True(t, d.Allowed)
					require.Equal(t, int64(2), d.Remaining)
				}
			})

			t.Run("allow_all", func(t *testing.T) {
				limits := testkit.NewDatabase(t, via, ratelimit.DatabaseOptions{Timeout: exactTimeout}) // the limits of one AllowAll
				perIP := testkit.Limiter(t, limits, ratelimit.Config{Name: "ip-" + m.name, Limit: 2, Window: time.Minute, DenyCacheSize: -1})
				perEmail := testkit.Limiter(t, limits, ratelimit.Config{Name: "email-" + m.name, Algorithm: ratelimit.SlidingWindow, Limit: 5, Window: time.Minute})
				global := testkit.Limiter(t, limits, ratelimit.Config{Name: "global-" + m.name, Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour})
				checks := []ratelimit.Check{{Limiter: perIP, Key: "1.2.3.4"}, {Limiter: perEmail, Key: "a@example.com"}, {Limiter: global, Key: "all"}}
				for i := range 2 {
					md, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
					require.NoError(t, err)
					require.True(t, md.Allowed, "decision %d", i)
					for _, d := range md.Decisions {
						require.Equal(t, ratelimit.StorePostgres, d.Store)
					}
				}
				md, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, checks...)
				require.NoError(t, err)
				require.False(t, md.Allowed)
				require.Equal(t, 0, md.DeniedBy)
				d, err := perEmail.Peek(ctx, "a@example.com")
				require.NoError(t, err)
				require.Equal(t, int64(3), d.Remaining, "the denied decision consumed nothing")
				md, err = ratelimit.AllowAll(ctx, ratelimit.ConsumeAll, ratelimit.Check{Limiter: perIP, Key: "1.2.3.4"}, ratelimit.Check{Limiter: global, Key: "all", Cost: 3})
				require.NoError(t, err)
				require.False(t, md.Allowed)
				d, err = global.Peek(ctx, "all")
				require.NoError(t, err)
				require.Equal(t, int64(95), d.Remaining, "consume-all counted the allowed limit")
			})
		})
	}
}

// bouncerSequence replays one random sequence of checks with a pinned clock
// through PgBouncer and directly, and requires identical decisions.
func bouncerSequence(t *testing.T, via, direct ratelimit.DB, mode string, alg ratelimit.Algorithm, penalty bool) {
	seed := uint64(len(mode))*100 + uint64(len(alg))
	if penalty {
		seed++
	}
	rng := rand.New(rand.NewPCG(seed, 3))
	window := []time.Duration{time.Second, 7 * time.Second, time.Minute}[rng.IntN(3)]
	now := time.Date(2030, 1, 2, 3, 4, 0, 0, time.UTC).Add(time.Duration(rng.IntN(1e6)) * time.Microsecond)
	cfg := ratelimit.Config{
		Name: fmt.Sprintf("seq-%s-%s-%v", mode, alg, penalty), Algorithm: alg, Limit: int64(3 + rng.IntN(8)),
		Window: window, Penalty: penalty, DenyCacheSize: -1,
	}
	if alg == ratelimit.TokenBucket {
		cfg.Burst = cfg.Limit + int64(rng.IntN(5))
	}
	// exactTimeout: the decisions are compared, so PostgreSQL must make
	// them, however busy the machine.
	clock := ratelimit.DatabaseOptions{Now: func() time.Time { return now }, Timeout: exactTimeout}
	lv, err := testkit.New(via, cfg, clock)
	require.NoError(t, err)
	ld, err := testkit.New(direct, cfg, clock)
	require.NoError(t, err)
	capacity := cfg.Limit
	if alg == ratelimit.TokenBucket {
		capacity = cfg.Burst
	}
	ctx := context.Background()
	allowed := 0
	for i := range 120 {
		key := []string{"a", "b", "c"}[rng.IntN(3)]
		cost := 1 + rng.Int64N(min(capacity, 4))
		if rng.IntN(4) != 0 {
			now = now.Add(time.Duration(rng.Int64N(window.Microseconds()*2/5)) * time.Microsecond)
		}
		dv, err := lv.Allow(ctx, key, ratelimit.Cost(cost))
		require.NoError(t, err)
		dd, err := ld.Allow(ctx, key, ratelimit.Cost(cost))
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, dv.Store, "%s step %d", cfg.Name, i)
		require.Equal(t, dd, dv, "%s step %d: the same decision through PgBouncer", cfg.Name, i)
		if dv.Allowed {
			allowed++
		}
	}
	require.Positive(t, allowed, cfg.Name)
	require.Less(t, allowed, 120, "%s: some checks were denied", cfg.Name)
}
