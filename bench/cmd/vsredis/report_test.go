package main

import (
	"bytes"
	"testing"

	"github.com/pgrl/pgrl/internal/golden"
)

// fixedReport is a report with every field set, so that the golden files
// pin the whole of both output formats.
func fixedReport() Report {
	r := Report{
		Machine: Machine{GOOS: "linux", GOARCH: "amd64", NumCPU: 2, CPUModel: "Example CPU @ 2.00GHz", GoVersion: "go1.26.0",
			PostgresVersion: "17.5 (Debian 17.5-1)", WalWriterFlushAfter: "1MB", SynchronousCommit: "on", RedisVersion: "7.0.15"},
		Schema:           "pgrl_redisbench",
		Algorithm:        "token_bucket",
		Limit:            "1/s, burst 1000000000",
		DurationSeconds:  5,
		WarmupSeconds:    1,
		MaxBatch:         64,
		MaxInFlight:      2,
		PgConnsFlag:      0,
		CompareCoalesced: true,
		Variants:         []string{"pgrl_inflight1"},
		Cases: []Case{
			{Callers: 8, Keys: 100000, PgConns: 8, RedisConns: 20, PgrlOpsPerSec: 18000.5, RedisRateOpsPerSec: 42000.1,
				Ratio: 0.429, PgrlP50Us: 400.2, PgrlP99Us: 900.8, RedisRateP50Us: 180.3, RedisRateP99Us: 420.9,
				PgrlChecks: 90000, RedisRateChecks: 210000, PgrlStatements: 30000, PgrlBatchStatements: 20000, PgrlAvgBatch: 3,
				PgrlClientCPUUsOp: 12.5, RedisClientCPUUsOp: 8.25, PgrlServerCPUUsOp: 30.1, RedisServerCPUUsOp: 5.5,
				PgrlMachineBusy: 0.97, RedisMachineBusy: 0.91,
				Uncoalesced: &Uncoalesced{OpsPerSec: 16000, P50Us: 450, P99Us: 1000, Checks: 80000, ClientCPUUsOp: 14,
					ServerCPUUsOp: 35, MachineBusy: 0.98, GainOps: 1.125, P50Ratio: 0.889},
				Variants: []Variant{{Name: "pgrl_inflight1", OpsPerSec: 17000, RatioVsRedis: 0.405, P50Us: 420, P99Us: 950,
					AvgBatch: 4.5, BatchStatement: 15000, ClientCPUUsOp: 11, ServerCPUUsOp: 28}}},
			{Callers: 64, Keys: 1, PgConns: 16, RedisConns: 64, PgrlOpsPerSec: 7000, RedisRateOpsPerSec: 15000, Ratio: 0.467},
		},
		Mix: mixDescription(mixRequests),
		MixCases: []MixCase{
			{Mix: "app", Callers: 8, PgConns: 8, RedisConns: 20, PgrlRequestsPerSec: 9000.5, RedisRateRequestsPerSec: 20000.2,
				Ratio: 0.45, PgrlChecksPerSec: 10800.6, RedisRateChecksPerSec: 24000.3, PgrlP50Us: 600.1, PgrlP99Us: 2500.2,
				RedisRateP50Us: 300.3, RedisRateP99Us: 900.4, PgrlRequests: 18001, RedisRateRequests: 40000, PgrlChecks: 21601,
				RedisRateChecks: 48000, PgrlPostgresChecks: 18000, PgrlStatements: 15000, PgrlRoundTrips: 12000,
				PgrlChecksPerStatement: 1.2, PgrlStatementsPerRoundTrip: 1.25, PgrlClientCPUUsReq: 40.5, RedisClientCPUUsReq: 20.25,
				PgrlServerCPUUsReq: 70.1, RedisServerCPUUsReq: 18.2, PgrlMachineBusy: 0.99, RedisMachineBusy: 0.95},
			{Mix: "app", Callers: 64, PgConns: 16, RedisConns: 64, PgrlRequestsPerSec: 15000, RedisRateRequestsPerSec: 16000, Ratio: 0.938},
		},
		Targets: defaultTargets,
	}
	r.TargetsMet, r.TargetMisses = r.Targets.check(r.Cases)
	return r
}

func TestReportFormatsUnchanged(t *testing.T) {
	r := fixedReport()
	if r.TargetsMet || len(r.TargetMisses) != 1 {
		t.Fatalf("the fixed report should miss one target: %v", r.TargetMisses)
	}
	var text, js bytes.Buffer
	if err := printText(&text, r); err != nil {
		t.Fatal(err)
	}
	if err := printJSON(&js, r); err != nil {
		t.Fatal(err)
	}
	golden.Check(t, "report.txt", text.Bytes())
	golden.Check(t, "report.json", js.Bytes())
}
