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
		Machine:         Machine{GOOS: "linux", GOARCH: "amd64", NumCPU: 2, GoVersion: "go1.26.0", ServerVersion: "17.5 (Debian 17.5-1)"},
		Schema:          "pgrl_bench",
		DurationSeconds: 5,
		WarmupSeconds:   1,
		Limit:           benchLimit,
		Window:          benchWindow.String(),
		Coalescing:      true,
		MaxInFlight:     0,
		Cases: []Case{
			{Algorithm: "fixed_window", Callers: 1, Keys: 100000, LibraryChecks: 30000, RawChecks: 31000,
				LibraryOpsPerSec: 6000.2, RawOpsPerSec: 6200.4, ThroughputRatio: 0.968, LibraryP50Us: 150.1, RawP50Us: 148.7,
				P50Ratio: 1.009, LibraryP99Us: 320.5, RawP99Us: 310.2, P99Ratio: 1.033},
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
