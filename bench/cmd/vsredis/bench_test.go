package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/loadtest"
)

// EnvRedisAddr points the tests at a Redis server they may write to (in
// database 15); bench/test.sh starts one and sets it.
const EnvRedisAddr = "PGRL_TEST_REDIS_ADDR"

// testRedisDB is the Redis database the tests write to, away from the
// default database 0.
const testRedisDB = "15"

// redisAddr returns the address of the test Redis: $PGRL_TEST_REDIS_ADDR,
// else 127.0.0.1:6379. When nothing answers there the test fails if the
// address was given or CI=true (there the test must run), and is skipped
// otherwise, saying how to run it.
func redisAddr(t *testing.T) string {
	t.Helper()
	addr, given := os.LookupEnv(EnvRedisAddr)
	if !given || addr == "" {
		addr, given = "127.0.0.1:6379", false
	}
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err == nil {
		_ = c.Close()
		return addr
	}
	msg := "no Redis at " + addr + " (" + err.Error() + "): run bash bench/test.sh, which starts one, or set " + EnvRedisAddr
	if given || os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

func TestBenchmarkEndToEnd(t *testing.T) {
	addr := redisAddr(t)
	schema := dbtest.NewSchema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{
		"--database-url", dbtest.URL(), "--schema", schema,
		"--redis-addr", addr, "--redis-db", testRedisDB,
		"--callers", "1,3", "--keys", "40,1", "--mix", "none", "--duration", "300ms", "--warmup", "60ms",
		"--compare-coalescing", "--variant", "in-flight=1", "--output", "json",
	}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("output is not a report: %v\n%s", err, stdout.String())
	}
	if rep.Machine.PostgresVersion == "" || rep.Machine.RedisVersion == "" || rep.Machine.NumCPU < 1 {
		t.Errorf("machine info incomplete: %+v", rep.Machine)
	}
	if len(rep.Cases) != 4 {
		t.Fatalf("%d cases, want 2 caller counts × 2 key spaces", len(rep.Cases))
	}
	for _, c := range rep.Cases {
		if c.PgrlChecks == 0 || c.RedisRateChecks == 0 || c.PgrlOpsPerSec <= 0 || c.RedisRateOpsPerSec <= 0 {
			t.Errorf("%+v: a path ran no checks", c)
		}
		if c.PgrlP50Us <= 0 || c.PgrlP50Us > c.PgrlP99Us || c.RedisRateP50Us <= 0 || c.RedisRateP50Us > c.RedisRateP99Us {
			t.Errorf("%+v: percentiles out of order", c)
		}
		if want := loadtest.Ratio(c.PgrlOpsPerSec, c.RedisRateOpsPerSec); abs(c.Ratio-want) > 0.01 {
			t.Errorf("%+v: ratio %v is not pgrl/redis_rate (%v)", c, c.Ratio, want)
		}
		// Every check went out in a statement, alone or batched.
		if c.PgrlStatements == 0 || int64(c.PgrlChecks) < c.PgrlStatements {
			t.Errorf("%+v: %d checks in %d statements", c, c.PgrlChecks, c.PgrlStatements)
		}
		if c.Uncoalesced == nil || c.Uncoalesced.Checks == 0 {
			t.Errorf("%+v: no uncoalesced path", c)
		}
		if len(c.Variants) != 1 || c.Variants[0].Name != "pgrl_inflight1" || c.Variants[0].OpsPerSec <= 0 {
			t.Errorf("%+v: variants %+v", c, c.Variants)
		}
	}
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

// TestLeasedEndToEnd runs the leased path: a key space and the mix with
// --lease-size on the fixed window. Every leased check is verified as it
// is made and the end-of-run check holds; checks are answered from slices,
// most of them in the key space.
func TestLeasedEndToEnd(t *testing.T) {
	addr := redisAddr(t)
	schema := dbtest.NewSchema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{
		"--database-url", dbtest.URL(), "--schema", schema,
		"--redis-addr", addr, "--redis-db", testRedisDB,
		"--callers", "4", "--keys", "10", "--mix", "app", "--mix-requests", "2000",
		"--algorithm", "fixed_window", "--lease-size", "50",
		"--duration", "300ms", "--warmup", "60ms", "--output", "json",
	}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("output is not a report: %v\n%s", err, stdout.String())
	}
	if rep.LeaseSize != 50 || rep.Algorithm != "fixed_window" || len(rep.Leased) != 9 || len(rep.Unleased) != 1 {
		t.Fatalf("lease size %d, algorithm %s, leased %v, unleased %v", rep.LeaseSize, rep.Algorithm, rep.Leased, rep.Unleased)
	}
	if len(rep.Cases) != 1 || len(rep.MixCases) != 1 {
		t.Fatalf("%d cases and %d mix cases, want 1 and 1", len(rep.Cases), len(rep.MixCases))
	}
	for what, s := range map[string]*LeaseStats{"key space": rep.Cases[0].Lease, "mix": rep.MixCases[0].Lease} {
		if s == nil {
			t.Fatalf("%s: no lease stats", what)
		}
		if !s.NeverOverLimit || s.Admitted == 0 || s.Slices == 0 || s.LocalDecisions == 0 {
			t.Errorf("%s: %+v: want admitted checks, some answered from slices, within the limit", what, s)
		}
		// Ten hot keys: after each key's first check (its own, lazy start),
		// its checks come from slices. Not asked of the mix, whose many
		// keys may each see a check or two in so short a run on a busy
		// machine, each its own.
		if what == "key space" && s.LocalDecisions <= s.DatabaseDecisions {
			t.Errorf("%s: %+v: want most checks answered from slices", what, s)
		}
		if s.UsedLocally+s.Returned+s.Dropped > s.UnitsLeased {
			t.Errorf("%s: %+v: more units used, returned and dropped than leased", what, s)
		}
	}
	if c := rep.Cases[0]; c.PgrlChecks == 0 || c.PgrlClientCPUUsOp <= 0 || c.RedisClientCPUUsOp <= 0 {
		t.Errorf("%+v: no checks, or no CPU per check", c)
	}
	var text bytes.Buffer
	if err := printText(&text, rep); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"leased (package lease, Size 50, Share 1, Idle 1m0s): vsredis, login-email-ip, login-ip, login-email, contact", "not leased: beacon", "lease, 4 callers, 10 keys:", "lease, mix, 4 callers:", "never over the limit: held"} {
		if !bytes.Contains(text.Bytes(), []byte(want)) {
			t.Errorf("text report lacks %q:\n%s", want, text.String())
		}
	}
}
