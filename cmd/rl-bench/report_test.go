package main

import (
	"bytes"
	"testing"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/golden"
)

// fixedReport is a report with every field set, so that the golden files
// pin the whole of both output formats.
func fixedReport() Report {
	r := Report{
		Machine: Machine{GOOS: "linux", GOARCH: "amd64", NumCPU: 2, GoVersion: "go1.26.0", ServerVersion: "17.5 (Debian 17.5-1)",
			AutovacuumOff: true},
		Schema:          "pgrl_bench",
		DurationSeconds: 5,
		WarmupSeconds:   1,
		Limit:           benchLimit,
		Window:          benchWindow.String(),
		Coalescing:      true,
		Policy:          true,
		PolicyOverrides: new(1000),
		MaxInFlight:     0,
		Cases: []Case{
			{Algorithm: "fixed_window", Callers: 1, Keys: 100000, LibraryChecks: 30000, RawChecks: 31000,
				LibraryOpsPerSec: 6000.2, RawOpsPerSec: 6200.4, ThroughputRatio: 0.968, LibraryP50Us: 150.1, RawP50Us: 148.7,
				P50Ratio: 1.009, LibraryP99Us: 320.5, RawP99Us: 310.2, P99Ratio: 1.033,
				StatementChecks: 30500, StatementOpsPerSec: 6100.3, StatementP50Us: 149.2, StatementP99Us: 315.8,
				StatementP50Ratio: 1.003, LibraryOverStatementP50: 1.006},
			{Algorithm: "token_bucket", Callers: 8, Keys: 1, LibraryChecks: 20000, RawChecks: 40000,
				LibraryOpsPerSec: 4000, RawOpsPerSec: 8000, ThroughputRatio: 0.5, LibraryP50Us: 1900, RawP50Us: 950,
				P50Ratio: 2, LibraryP99Us: 5000, RawP99Us: 2500, P99Ratio: 2},
		},
		HotUpdateRatio: map[string]float64{"pgrl_token_bucket": 0.5, "pgrl_fixed_window": 0.9987},
		TableUpdates: map[string]tableCounters{
			"pgrl_token_bucket": {Updates: 60000, HotUpdates: 30000},
			"pgrl_fixed_window": {Updates: 61000, HotUpdates: 60921},
		},
		Targets: defaultTargets,
	}
	r.TargetsMet, r.TargetMisses = r.Targets.check(r)
	return r
}

func TestReportFormatsUnchanged(t *testing.T) {
	r := fixedReport()
	if r.TargetsMet || len(r.TargetMisses) != 3 {
		t.Fatalf("the fixed report should miss three targets: %v", r.TargetMisses)
	}
	var text, js bytes.Buffer
	if err := printText(&text, r); err != nil {
		t.Fatal(err)
	}
	if err := cli.PrintJSON(&js, r); err != nil {
		t.Fatal(err)
	}
	golden.Check(t, "report.txt", text.Bytes())
	golden.Check(t, "report.json", js.Bytes())
}

// fixedConcurrencyReport is a --concurrency report with every field set.
func fixedConcurrencyReport() Report {
	calls := int64(18)
	r := Report{
		Machine: Machine{GOOS: "linux", GOARCH: "amd64", NumCPU: 2, GoVersion: "go1.26.0", ServerVersion: "17.5 (Debian 17.5-1)",
			AutovacuumOff: true},
		Schema:            "pgrl_bench",
		DurationSeconds:   3,
		WarmupSeconds:     1,
		Limit:             benchLimit,
		Window:            benchWindow.String(),
		Coalescing:        true,
		Concurrency:       true,
		ConcurrencyLimit:  concurrencyLimit,
		ConcurrencyWindow: concurrencyLease.String(),
		ConcurrencyCases: []ConcurrencyCase{
			{Callers: 1, Keys: 100000, AllowChecks: 20000, Acquires: 9000, AllowOpsPerSec: 6500.5, AcquireOpsPerSec: 3000.1,
				AllowP50Us: 150.2, AllowP99Us: 400.1, AcquireP50Us: 160.3, AcquireP99Us: 420.7, AcquireReleaseP50Us: 320.9,
				AcquireReleaseP99Us: 800.4, AcquireP50Ratio: 1.067, AcquireReleaseP50Ratio: 2.137},
			{Callers: 8, Keys: 1, AllowChecks: 60000, Acquires: 12000, AllowOpsPerSec: 20000, AcquireOpsPerSec: 4000,
				AllowP50Us: 380, AllowP99Us: 1900, AcquireP50Us: 900, AcquireP99Us: 4000, AcquireReleaseP50Us: 1900,
				AcquireReleaseP99Us: 7000, AcquireP50Ratio: 2.368, AcquireReleaseP50Ratio: 5, AcquireFallbacks: 3},
		},
		Holds: &HoldReport{
			WindowSeconds: 30, IntervalSeconds: 10, HoldSeconds: 65,
			Cases: []HoldCase{
				{Slots: 1, Keys: 1, HeldSeconds: 65, Statements: 6, ExpectedStatements: 6, StatementsPerMinute: 5.998,
					PerSlotPerMinute: 5.998, ExpectedPerSlotPerMinute: 6, StatementP50Ms: 0.61, StatementMaxMs: 1.2},
				{Slots: 1000, Keys: 100, HeldSeconds: 65.3, Statements: 6, ExpectedStatements: 6, StatementsPerMinute: 5.991,
					PerSlotPerMinute: 0.005991, ExpectedPerSlotPerMinute: 0.006, StatementP50Ms: 9.87, StatementMaxMs: 14.02},
			},
			Statements: 12, RowWrites: 2608, ExpectedRowWrites: 2608,
			PgStatStatementsCalls: &calls, PgStatStatements: "calls of the extension statement in this database, by any session",
		},
		HotUpdateRatio: map[string]float64{"pgrl_concurrency": 0.99, "pgrl_fixed_window": 0.9987},
		TableUpdates: map[string]tableCounters{
			"pgrl_concurrency":  {Updates: 42000, HotUpdates: 41580},
			"pgrl_fixed_window": {Updates: 80000, HotUpdates: 79896},
		},
		Targets: defaultTargets,
	}
	r.TargetsMet, r.TargetMisses = r.Targets.check(r)
	return r
}

func TestConcurrencyReportFormatsUnchanged(t *testing.T) {
	r := fixedConcurrencyReport()
	var text, js bytes.Buffer
	if err := printText(&text, r); err != nil {
		t.Fatal(err)
	}
	if err := cli.PrintJSON(&js, r); err != nil {
		t.Fatal(err)
	}
	golden.Check(t, "report_concurrency.txt", text.Bytes())
	golden.Check(t, "report_concurrency.json", js.Bytes())
}

func TestReportNotesAutovacuumOnlyWhenOff(t *testing.T) {
	r := fixedReport()
	for _, off := range []bool{true, false} {
		r.Machine.AutovacuumOff = off
		var text bytes.Buffer
		if err := printText(&text, r); err != nil {
			t.Fatal(err)
		}
		if got := bytes.Contains(text.Bytes(), []byte("autovacuum is off")); got != off {
			t.Errorf("autovacuum off %v: the report notes it: %v\n%s", off, got, text.String())
		}
	}
}
