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
