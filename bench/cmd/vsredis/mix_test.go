package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pgrl/pgrl/internal/dbtest"
)

func TestPickWeighted(t *testing.T) {
	total := 0
	for _, e := range appEndpoints {
		total += e.weight
	}
	if total != 100 {
		t.Fatalf("endpoint weights add up to %d, want 100 (they are percentages)", total)
	}
	// Each endpoint owns exactly its weight's worth of [0, 100), in order.
	for u, want := 0, 0; u < total; u++ {
		lo := 0
		for _, e := range appEndpoints[:want] {
			lo += e.weight
		}
		if u >= lo+appEndpoints[want].weight {
			want++
		}
		if got := pickWeighted(u); got != want {
			t.Fatalf("pickWeighted(%d) = %s, want %s", u, appEndpoints[got].name, appEndpoints[want].name)
		}
	}
	for _, c := range []struct {
		u    int
		want string
	}{{0, "public-api"}, {49, "public-api"}, {50, "beacon"}, {69, "beacon"}, {70, "login"}, {79, "login"}, {99, "confirmation"}} {
		if got := appEndpoints[pickWeighted(c.u)].name; got != c.want {
			t.Errorf("pickWeighted(%d) = %s, want %s", c.u, got, c.want)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("pickWeighted(100): no panic past the sum of the weights")
		}
	}()
	pickWeighted(total)
}

func TestMixFollowsTheWeights(t *testing.T) {
	m := newAppMix(mixSeed, mixRequests)
	counts := m.endpointCounts()
	for i, e := range appEndpoints {
		share := 100 * float64(counts[i]) / float64(len(m.requests))
		if math.Abs(share-float64(e.weight)) > 1 {
			t.Errorf("%s: %.2f%% of the requests, want %d%% ± 1", e.name, share, e.weight)
		}
	}
	for i, r := range m.requests {
		ep := appEndpoints[r.endpoint]
		if len(r.checks) != len(ep.limits) {
			t.Fatalf("request %d (%s): %d checks, want %d", i, ep.name, len(r.checks), len(ep.limits))
		}
		for j, c := range r.checks {
			if c.limit != ep.limits[j] || c.key == "" || c.redisKey != appLimits[c.limit].name+":"+c.key {
				t.Fatalf("request %d (%s), check %d: %+v", i, ep.name, j, c)
			}
		}
		if ep.name == "login" {
			pair, ip, email := r.checks[0].key, r.checks[1].key, r.checks[2].key
			if pair != loginPairKey(email, ip) || !strings.HasSuffix(email, "@example.com") || !strings.HasPrefix(ip, "10.") {
				t.Fatalf("login %d keys %q %q %q: want the email+IP pair, the IP and the email", i, pair, ip, email)
			}
		}
	}
}

func TestMixDrawIsDeterministicAndSkewed(t *testing.T) {
	a, b := newAppMix(7, 20_000), newAppMix(7, 20_000)
	if !reflect.DeepEqual(a.requests, b.requests) || !reflect.DeepEqual(a.touch, b.touch) {
		t.Fatal("two draws from the same seed differ")
	}
	if reflect.DeepEqual(a.requests, newAppMix(8, 20_000).requests) {
		t.Fatal("draws from seeds 7 and 8 are the same")
	}

	// Count the users of the public API and the addresses of the beacon.
	users, ips := map[string]int{}, map[string]int{}
	nUsers, nIPs := 0, 0
	for _, r := range a.requests {
		switch appEndpoints[r.endpoint].name {
		case "public-api":
			users[strings.TrimPrefix(r.checks[0].key, "key:")]++
			nUsers++
		case "beacon":
			ips[r.checks[0].key]++
			nIPs++
		}
	}
	// With s = 1.1 over 10,000 users, rank 0 has a share of 1/H where
	// H = Σ (k+1)^-1.1 ≈ 6.6: about 15 %; rank 1 about 7 %. Uniform keys
	// would give each 0.01 %.
	h := 0.0
	for k := range mixUsers {
		h += math.Pow(float64(k+1), -mixZipfS)
	}
	for rank, want := range []float64{1 / h, math.Pow(2, -mixZipfS) / h} {
		got := float64(users[userName(rank)]) / float64(nUsers)
		if math.Abs(got-want) > 0.02 {
			t.Errorf("user of rank %d: share %.3f, want %.3f ± 0.02", rank, got, want)
		}
	}
	if users[userName(0)] <= users[userName(1)] || users[userName(1)] <= users[userName(100)] {
		t.Errorf("users of ranks 0, 1, 100 drawn %d, %d, %d times: want fewer for lower ranks", users[userName(0)], users[userName(1)], users[userName(100)])
	}
	if got := float64(ips[ipAddr(0)]) / float64(nIPs); got < 0.12 || got > 0.25 {
		t.Errorf("busiest address: share %.3f, want about 0.17", got)
	}
	if len(users) > mixUsers || len(ips) > mixIPs {
		t.Errorf("%d users and %d addresses drawn, more than the populations", len(users), len(ips))
	}
	if ipAddr(0) != "10.0.0.0" || ipAddr(mixIPs-1) != "10.0.7.207" {
		t.Errorf("addresses %s, %s", ipAddr(0), ipAddr(mixIPs-1))
	}
}

func TestMixTouchesEveryKeyOnce(t *testing.T) {
	m := newAppMix(3, 5_000)
	touched := map[mixCheck]bool{}
	for _, c := range m.touch {
		if touched[c] {
			t.Fatalf("%+v touched twice", c)
		}
		touched[c] = true
	}
	for _, r := range m.requests {
		for _, c := range r.checks {
			if !touched[c] {
				t.Fatalf("%+v never touched", c)
			}
		}
	}
}

func TestMixLimitersAreValid(t *testing.T) {
	// New and NewMemory validate without touching the database.
	lims, err := newMixLimiters(&countingDB{}, options{})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for i, l := range appLimits {
		if (lims.db[i] == nil) != l.memory {
			t.Errorf("%s: memory %v but database limiter %v", l.name, l.memory, lims.db[i])
		}
		if names[l.name] {
			t.Errorf("two limits named %s", l.name)
		}
		names[l.name] = true
		if got := redisMixLimits[i]; got.Rate != int(l.rate) || got.Period != l.period || got.Burst != int(l.burst) {
			t.Errorf("%s: redis_rate limit %v, pgrl %d per %v burst %d", l.name, got, l.rate, l.period, l.burst)
		}
	}
	if lims.beacon == nil || len(names) != 9 {
		t.Errorf("%d limits, beacon %v: want the nine of the policy table, the beacon in memory", len(names), lims.beacon)
	}
}

func TestMixCaseOf(t *testing.T) {
	pg := &path{single: 100, many: 400, batches: 50, batched: 200, checks: 1_500, pgChecks: 1_200,
		cpu: 30 * time.Millisecond, server: 60 * time.Millisecond, busy: cpuSample{busy: 90, total: 100}}
	pg.Elapsed = 2 * time.Second
	for i := range 1_000 {
		pg.Latencies = append(pg.Latencies, int64(i+1)*1_000) // 1 µs to 1 ms
	}
	rd := &path{checks: 3_300, cpu: 22 * time.Millisecond, server: 11 * time.Millisecond}
	rd.Elapsed = 2 * time.Second
	for i := range 2_200 {
		rd.Latencies = append(rd.Latencies, int64(i+1)*100)
	}
	c := mixCaseOf(8, 8, 20, pg, rd)
	want := MixCase{
		Mix: "app", Callers: 8, PgConns: 8, RedisConns: 20,
		PgrlRequestsPerSec: 500, RedisRateRequestsPerSec: 1_100, Ratio: 0.455,
		PgrlChecksPerSec: 750, RedisRateChecksPerSec: 1_650,
		PgrlP50Us: 501, PgrlP99Us: 991, RedisRateP50Us: 110.1, RedisRateP99Us: 217.9,
		PgrlRequests: 1_000, RedisRateRequests: 2_200, PgrlChecks: 1_500, RedisRateChecks: 3_300, PgrlPostgresChecks: 1_200,
		// 100 lone + 400 coalesced + 200 in 50 batches.
		PgrlStatements: 700, PgrlRoundTrips: 550, PgrlChecksPerStatement: 1.71, PgrlStatementsPerRoundTrip: 1.27,
		PgrlClientCPUUsReq: 30, RedisClientCPUUsReq: 10, PgrlServerCPUUsReq: 60, RedisServerCPUUsReq: 5,
		PgrlMachineBusy: 0.9,
	}
	if c != want {
		t.Fatalf("got  %+v\nwant %+v", c, want)
	}
}

func TestMixEndToEnd(t *testing.T) {
	addr := redisAddr(t)
	schema := dbtest.NewSchema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	// A few hot keys and the application mix, at one number of callers,
	// over a small draw of requests so that touching its keys is quick.
	code := run(ctx, []string{
		"--database-url", dbtest.URL(), "--schema", schema,
		"--redis-addr", addr, "--redis-db", testRedisDB,
		"--callers", "4", "--keys", "10", "--mix", "app", "--mix-requests", "2000",
		"--duration", "300ms", "--warmup", "60ms", "--output", "json",
	}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("output is not a report: %v\n%s", err, stdout.String())
	}
	if len(rep.Cases) != 1 || rep.Cases[0].Keys != 10 || rep.Cases[0].PgrlChecks == 0 || rep.Cases[0].RedisRateChecks == 0 {
		t.Fatalf("cases %+v, want one of 10 keys with checks on both sides", rep.Cases)
	}
	if rep.Mix == nil || len(rep.Mix.Limits) != 9 || len(rep.Mix.Endpoints) != len(appEndpoints) || rep.Mix.Requests != 2000 {
		t.Fatalf("mix description %+v", rep.Mix)
	}
	if len(rep.MixCases) != 1 {
		t.Fatalf("%d mix cases, want 1", len(rep.MixCases))
	}
	c := rep.MixCases[0]
	if c.Callers != 4 || c.PgrlRequests == 0 || c.RedisRateRequests == 0 || c.PgrlRequestsPerSec <= 0 || c.RedisRateRequestsPerSec <= 0 {
		t.Fatalf("%+v: a side made no requests", c)
	}
	// Logins make three checks, the others one; the beacon is in memory on
	// pgrl's side.
	if c.PgrlChecks <= int64(c.PgrlRequests) || c.RedisRateChecks <= int64(c.RedisRateRequests) {
		t.Errorf("%+v: no more checks than requests: no login ran its three", c)
	}
	if c.PgrlPostgresChecks == 0 || c.PgrlPostgresChecks >= c.PgrlChecks {
		t.Errorf("%+v: %d of %d checks in PostgreSQL: want all but the beacon's", c, c.PgrlPostgresChecks, c.PgrlChecks)
	}
	if c.PgrlChecksPerSec < c.PgrlRequestsPerSec || c.RedisRateChecksPerSec < c.RedisRateRequestsPerSec {
		t.Errorf("%+v: fewer checks/s than requests/s", c)
	}
	// Every round trip is one statement, logins included: a login's three
	// checks are decided together inside one statement, so there are more
	// checks than statements.
	if c.PgrlRoundTrips == 0 || c.PgrlStatements != c.PgrlRoundTrips || c.PgrlStatementsPerRoundTrip != 1 || c.PgrlChecksPerStatement <= 1 {
		t.Errorf("%+v: %d statements in %d round trips", c, c.PgrlStatements, c.PgrlRoundTrips)
	}
	if c.PgrlP50Us <= 0 || c.PgrlP50Us > c.PgrlP99Us || c.RedisRateP50Us <= 0 || c.RedisRateP50Us > c.RedisRateP99Us {
		t.Errorf("%+v: percentiles out of order", c)
	}
}
