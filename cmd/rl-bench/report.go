package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
)

// Report is rl-bench's result; --output json prints it as one object.
type Report struct {
	// Machine describes where the benchmark ran.
	Machine Machine `json:"machine"`
	// Schema holds the benchmark's tables.
	Schema string `json:"schema"`
	// DurationSeconds is the measured time per path per case.
	DurationSeconds float64 `json:"duration_seconds"`
	// WarmupSeconds is the unmeasured time per case.
	WarmupSeconds float64 `json:"warmup_seconds"`
	// Limit and Window are the limit every check is made against: high
	// enough that every check is admitted.
	Limit  int64  `json:"limit"`
	Window string `json:"window"`
	// Coalescing reports whether the library path ran with the limiter's
	// coalescing of concurrent checks on (its default). When it is, checks
	// that arrive while round trips are running are sent together in one
	// multi-key statement, which the raw path does not imitate.
	Coalescing bool `json:"coalescing"`
	// Policy reports whether the library path read its limit from a stored
	// policy in each check's statement (--policy).
	Policy bool `json:"policy,omitempty"`
	// PolicyOverrides is how many overrides, all of other keys, the stored
	// policy had (--policy-overrides); nil without --policy.
	PolicyOverrides *int `json:"policy_overrides,omitempty"`
	// RequestIDs reports whether every library check carried a request id
	// of its own (--request-ids).
	RequestIDs bool `json:"request_ids,omitempty"`
	// SQLCheck reports whether the library path was the SQL function
	// pgrl_check (--sql-check).
	SQLCheck bool `json:"sql_check,omitempty"`
	// MaxInFlight is the library's DatabaseOptions.MaxInFlight; 0 is its default.
	MaxInFlight int `json:"max_in_flight"`
	// Cases holds one entry per algorithm, number of callers and key spread.
	Cases []Case `json:"cases"`
	// Concurrency reports whether the run measured acquires of a
	// concurrency limit against fixed-window checks (--concurrency):
	// ConcurrencyCases and Holds then hold its figures, and Cases is
	// empty. ConcurrencyLimit and ConcurrencyWindow are the acquired
	// limit's Limit and Window.
	Concurrency       bool              `json:"concurrency,omitempty"`
	ConcurrencyLimit  int64             `json:"concurrency_limit,omitempty"`
	ConcurrencyWindow string            `json:"concurrency_window,omitempty"`
	ConcurrencyCases  []ConcurrencyCase `json:"concurrency_cases,omitempty"`
	// Holds is what holding slots cost (--concurrency, unless --hold-for
	// is 0).
	Holds *HoldReport `json:"holds,omitempty"`
	// HotUpdateRatio maps each counter table updated during the run to the
	// share of its updates that were HOT (n_tup_hot_upd / n_tup_upd).
	HotUpdateRatio map[string]float64 `json:"hot_update_ratio"`
	// TableUpdates holds the update counts behind HotUpdateRatio.
	TableUpdates map[string]tableCounters `json:"table_updates"`
	// Targets are the thresholds the run is checked against; TargetsMet
	// reports whether every case and table met them, and TargetMisses
	// lists the ones that did not.
	Targets      Targets  `json:"targets"`
	TargetsMet   bool     `json:"targets_met"`
	TargetMisses []string `json:"target_misses,omitempty"`
}

// Machine describes the client and the server of a run.
type Machine struct {
	GOOS          string `json:"goos"`
	GOARCH        string `json:"goarch"`
	NumCPU        int    `json:"num_cpu"`
	GoVersion     string `json:"go_version"`
	ServerVersion string `json:"server_version"`
	// AutovacuumOff reports that the server ran with autovacuum off: pgrl's
	// tables were then never analyzed or vacuumed by it, as they are on a
	// production server, and the plans of the statements that read a row
	// before writing it (the check functions of coalesced checks) can differ
	// from production's. See docs/BENCHMARKS.md, "Machine".
	AutovacuumOff bool `json:"autovacuum_off,omitempty"`
}

// Case is one algorithm at one number of callers over one key spread.
// Ratios are library over raw: a throughput ratio of 1 and latency ratios
// of 1 mean the library costs nothing beyond its statement.
type Case struct {
	Algorithm        string  `json:"algorithm"`
	Callers          int     `json:"callers"`
	Keys             int     `json:"keys"`
	LibraryChecks    int     `json:"library_checks"`
	RawChecks        int     `json:"raw_checks"`
	LibraryOpsPerSec float64 `json:"library_ops_per_sec"`
	RawOpsPerSec     float64 `json:"raw_ops_per_sec"`
	ThroughputRatio  float64 `json:"throughput_ratio"`
	LibraryP50Us     float64 `json:"library_p50_us"`
	RawP50Us         float64 `json:"raw_p50_us"`
	P50Ratio         float64 `json:"p50_ratio"`
	LibraryP99Us     float64 `json:"library_p99_us"`
	RawP99Us         float64 `json:"raw_p99_us"`
	P99Ratio         float64 `json:"p99_ratio"`
	// The Statement figures are those of a third path, measured with
	// --policy and --request-ids only: the feature's own statement (the
	// take that reads the stored policy, or that stores its answer under a
	// request id) sent directly, with no library around it.
	// StatementP50Ratio is its p50 over the raw statement's: what
	// PostgreSQL charges for the feature. LibraryOverStatementP50 is the
	// library's p50 over it: what the client adds. Their product is
	// P50Ratio, give or take the rounding.
	StatementChecks         int     `json:"statement_checks,omitempty"`
	StatementOpsPerSec      float64 `json:"statement_ops_per_sec,omitempty"`
	StatementP50Us          float64 `json:"statement_p50_us,omitempty"`
	StatementP99Us          float64 `json:"statement_p99_us,omitempty"`
	StatementP50Ratio       float64 `json:"statement_p50_ratio,omitempty"`
	LibraryOverStatementP50 float64 `json:"library_over_statement_p50,omitempty"`
}

// Targets are what a run should show: the library within a small margin of
// its raw statement, and counter updates that stay HOT.
type Targets struct {
	MinThroughputRatio float64 `json:"min_throughput_ratio"`
	MaxP50Ratio        float64 `json:"max_p50_ratio"`
	MinHotUpdateRatio  float64 `json:"min_hot_update_ratio"`
}

var defaultTargets = Targets{MinThroughputRatio: 0.85, MaxP50Ratio: 1.2, MinHotUpdateRatio: 0.95}

func (t Targets) check(r Report) (bool, []string) {
	var misses []string
	for _, c := range r.Cases {
		name := fmt.Sprintf("%s, %d callers, %d keys", c.Algorithm, c.Callers, c.Keys)
		if c.ThroughputRatio < t.MinThroughputRatio {
			misses = append(misses, fmt.Sprintf("%s: throughput ratio %.3f < %.2f", name, c.ThroughputRatio, t.MinThroughputRatio))
		}
		if c.P50Ratio > t.MaxP50Ratio {
			misses = append(misses, fmt.Sprintf("%s: p50 ratio %.3f > %.2f", name, c.P50Ratio, t.MaxP50Ratio))
		}
	}
	for _, name := range sortedKeys(r.HotUpdateRatio) {
		if v := r.HotUpdateRatio[name]; v < t.MinHotUpdateRatio {
			misses = append(misses, fmt.Sprintf("%s: HOT-update ratio %.4f < %.2f", name, v, t.MinHotUpdateRatio))
		}
	}
	return len(misses) == 0, misses
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// printText writes the report as a table.
func printText(w io.Writer, r Report) error {
	coalescing := "on"
	if !r.Coalescing {
		coalescing = "off"
	}
	if r.Policy {
		overrides := 0
		if r.PolicyOverrides != nil {
			overrides = *r.PolicyOverrides
		}
		coalescing += fmt.Sprintf(" (the library reads a stored policy with %d overrides of other keys in each check's statement, coalesced or not)", overrides)
	}
	if r.RequestIDs {
		coalescing = "off (every check carries a request id of its own, and is a statement of its own)"
	}
	if r.SQLCheck {
		coalescing = "off (the library path is SELECT allowed FROM pgrl_check(policy, key), one call per check)"
	}
	if r.Concurrency {
		if err := printConcurrency(w, r, coalescing); err != nil {
			return err
		}
		return printHOT(w, r)
	}
	paths := "raw and library"
	if hasStatementPath(r) {
		paths = "raw, library and statement"
	}
	fmt.Fprintf(w, "PostgreSQL %s, client %s/%s with %d CPUs; %gs per path per case, %s interleaved; library coalescing %s\n%s\n",
		r.Machine.ServerVersion, r.Machine.GOOS, r.Machine.GOARCH, r.Machine.NumCPU, r.DurationSeconds, paths, coalescing,
		serverNote(r.Machine))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "algorithm\tcallers\tkeys\traw ops/s\tlib ops/s\tratio\traw p50 µs\tlib p50 µs\tratio\traw p99 µs\tlib p99 µs\tratio\t")
	for _, c := range r.Cases {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%.0f\t%.3f\t%.1f\t%.1f\t%.3f\t%.1f\t%.1f\t%.3f\t\n",
			c.Algorithm, c.Callers, c.Keys, c.RawOpsPerSec, c.LibraryOpsPerSec, c.ThroughputRatio,
			c.RawP50Us, c.LibraryP50Us, c.P50Ratio, c.RawP99Us, c.LibraryP99Us, c.P99Ratio)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := printStatements(w, r); err != nil {
		return err
	}
	return printHOT(w, r)
}

// hasStatementPath reports whether the run measured the third path
// (--policy, --request-ids).
func hasStatementPath(r Report) bool {
	return slices.ContainsFunc(r.Cases, func(c Case) bool { return c.StatementChecks > 0 })
}

// printStatements writes the third path's figures (--policy and
// --request-ids), when the run has them.
func printStatements(w io.Writer, r Report) error {
	if !hasStatementPath(r) {
		return nil
	}
	feature := "reads the stored policy"
	if r.RequestIDs {
		feature = "stores its answer under a request id"
	}
	fmt.Fprintf(w, "\nThe take that %s, sent directly (no library), interleaved with the other two paths:\n", feature)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "algorithm\tcallers\tkeys\tstmt ops/s\tstmt p50 µs\tstmt/raw p50\tlib/stmt p50\tstmt p99 µs\t")
	for _, c := range r.Cases {
		if c.StatementChecks == 0 {
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%.1f\t%.3f\t%.3f\t%.1f\t\n", c.Algorithm, c.Callers, c.Keys,
			c.StatementOpsPerSec, c.StatementP50Us, c.StatementP50Ratio, c.LibraryOverStatementP50, c.StatementP99Us)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "stmt/raw is what PostgreSQL charges for the feature; lib/stmt is what the library adds to its statement.")
	return nil
}

// serverNote is what the report says of the server's settings that make a
// run unlike production: empty, or one line.
func serverNote(m Machine) string {
	if !m.AutovacuumOff {
		return ""
	}
	return "Note: autovacuum is off on this server, so pgrl's tables are neither analyzed nor vacuumed as they are in production; turn it on, or run ANALYZE on pgrl's tables after the first run, for production's plans\n"
}

// printHOT writes the HOT-update ratios and the targets.
func printHOT(w io.Writer, r Report) error {
	fmt.Fprintf(w, "\nHOT updates during the run (n_tup_hot_upd / n_tup_upd):\n")
	for _, name := range sortedKeys(r.HotUpdateRatio) {
		u := r.TableUpdates[name]
		fmt.Fprintf(w, "  %-24s %.4f  (%d of %d)\n", name, r.HotUpdateRatio[name], u.HotUpdates, u.Updates)
	}
	if r.Concurrency {
		// No target holds an acquire to the cost of a check.
		fmt.Fprintf(w, "\nTargets: HOT ratio >= %.2f: ", r.Targets.MinHotUpdateRatio)
	} else {
		fmt.Fprintf(w, "\nTargets: throughput ratio >= %.2f, p50 ratio <= %.2f, HOT ratio >= %.2f: ",
			r.Targets.MinThroughputRatio, r.Targets.MaxP50Ratio, r.Targets.MinHotUpdateRatio)
	}
	if r.TargetsMet {
		fmt.Fprintln(w, "all met")
		return nil
	}
	fmt.Fprintf(w, "missed\n  %s\n", strings.Join(r.TargetMisses, "\n  "))
	return nil
}

// printConcurrency writes the --concurrency cases and the hold.
func printConcurrency(w io.Writer, r Report, coalescing string) error {
	fmt.Fprintf(w, "PostgreSQL %s, client %s/%s with %d CPUs; %gs per path per case, acquire+release and fixed-window allow interleaved; "+
		"concurrency Limit %d, Window %s; allow coalescing %s (an acquire goes out alone)\n%s\n",
		r.Machine.ServerVersion, r.Machine.GOOS, r.Machine.GOARCH, r.Machine.NumCPU, r.DurationSeconds,
		r.ConcurrencyLimit, r.ConcurrencyWindow, coalescing, serverNote(r.Machine))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "callers\tkeys\tallow ops/s\tacq+rel ops/s\tallow p50 µs\tacquire p50 µs\tratio\tacq+rel p50 µs\tratio\tallow p99 µs\tacquire p99 µs\tacq+rel p99 µs\t")
	for _, c := range r.ConcurrencyCases {
		fmt.Fprintf(tw, "%d\t%d\t%.0f\t%.0f\t%.1f\t%.1f\t%.3f\t%.1f\t%.3f\t%.1f\t%.1f\t%.1f\t\n",
			c.Callers, c.Keys, c.AllowOpsPerSec, c.AcquireOpsPerSec, c.AllowP50Us, c.AcquireP50Us, c.AcquireP50Ratio,
			c.AcquireReleaseP50Us, c.AcquireReleaseP50Ratio, c.AllowP99Us, c.AcquireP99Us, c.AcquireReleaseP99Us)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, c := range r.ConcurrencyCases {
		if c.AllowFallbacks > 0 || c.AcquireFallbacks > 0 {
			fmt.Fprintf(w, "  %d callers, %d keys: %d allows and %d acquires answered by the failure policy, not PostgreSQL\n",
				c.Callers, c.Keys, c.AllowFallbacks, c.AcquireFallbacks)
		}
	}
	h := r.Holds
	if h == nil {
		return nil
	}
	fmt.Fprintf(w, "\nSlots held for %gs, Window %gs (an extension statement every %gs per Database):\n",
		h.HoldSeconds, h.WindowSeconds, h.IntervalSeconds)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "slots\tkeys\theld s\tstatements\texpected\tper minute\tper slot per minute\texpected\tp50 ms\tmax ms\tlost\t")
	for _, c := range h.Cases {
		fmt.Fprintf(tw, "%d\t%d\t%.1f\t%d\t%d\t%.3f\t%.6f\t%.6f\t%.2f\t%.2f\t%d\t\n",
			c.Slots, c.Keys, c.HeldSeconds, c.Statements, c.ExpectedStatements, c.StatementsPerMinute,
			c.PerSlotPerMinute, c.ExpectedPerSlotPerMinute, c.StatementP50Ms, c.StatementMaxMs, c.Lost)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "Extension statements counted through the Databases: %d; rows of pgrl_concurrency written: %d, expected %d "+
		"(an acquire, a release, and a key of an extension each)\n", h.Statements, h.RowWrites, h.ExpectedRowWrites)
	if h.PgStatStatementsCalls != nil {
		fmt.Fprintf(w, "pg_stat_statements: %d (%s)\n", *h.PgStatStatementsCalls, h.PgStatStatements)
	} else {
		fmt.Fprintf(w, "pg_stat_statements: %s\n", h.PgStatStatements)
	}
	return nil
}
