package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Report is the result of one run; --output json prints it.
type Report struct {
	Machine          Machine  `json:"machine"`
	Schema           string   `json:"schema"`
	Algorithm        string   `json:"algorithm"`
	Limit            string   `json:"limit"`
	DurationSeconds  float64  `json:"duration_seconds"`
	WarmupSeconds    float64  `json:"warmup_seconds"`
	MaxBatch         int      `json:"max_batch"`     // 0: the library's default
	MaxInFlight      int      `json:"max_in_flight"` // 0: the library's default
	PgConnsFlag      int      `json:"pg_conns_flag"` // 0: min(callers, 16)
	CompareCoalesced bool     `json:"compare_coalescing"`
	Variants         []string `json:"variants,omitempty"`
	// LeaseSize is --lease-size (0: no leases); Leased names the limits
	// whose checks pgrl answered through package lease, and Unleased
	// those it left unleased in a leased run, with why.
	LeaseSize int64 `json:"lease_size,omitempty"`
	// LeaseShare and LeaseIdle are --lease-share and --lease-idle.
	LeaseShare int      `json:"lease_share,omitempty"`
	LeaseIdle  string   `json:"lease_idle,omitempty"`
	Leased     []string `json:"leased,omitempty"`
	Unleased   []string `json:"unleased,omitempty"`
	Cases      []Case   `json:"cases"`
	// Mix describes the application mix, and MixCases are its cases, with
	// --mix app.
	Mix          *MixInfo  `json:"mix,omitempty"`
	MixCases     []MixCase `json:"mix_cases,omitempty"`
	Targets      Targets   `json:"targets"`
	TargetsMet   bool      `json:"targets_met"`
	TargetMisses []string  `json:"target_misses,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	GOOS            string `json:"goos"`
	GOARCH          string `json:"goarch"`
	NumCPU          int    `json:"num_cpu"`
	CPUModel        string `json:"cpu_model,omitempty"`
	GoVersion       string `json:"go_version"`
	PostgresVersion string `json:"postgres_version"`
	// WalWriterFlushAfter and SynchronousCommit are the server's settings
	// that change the cost of a commit (docs/REDIS.md).
	WalWriterFlushAfter string `json:"wal_writer_flush_after"`
	SynchronousCommit   string `json:"synchronous_commit"`
	RedisVersion        string `json:"redis_version"`
}

// Case is one number of callers over one key space.
type Case struct {
	Callers    int `json:"callers"`
	Keys       int `json:"keys"`
	PgConns    int `json:"pg_conns"`
	RedisConns int `json:"redis_conns"`

	PgrlOpsPerSec      float64 `json:"pgrl_ops_per_sec"`
	RedisRateOpsPerSec float64 `json:"redis_rate_ops_per_sec"`
	// Ratio is pgrl's ops/s over redis_rate's.
	Ratio          float64 `json:"ratio"`
	PgrlP50Us      float64 `json:"pgrl_p50_us"`
	PgrlP99Us      float64 `json:"pgrl_p99_us"`
	RedisRateP50Us float64 `json:"redis_rate_p50_us"`
	RedisRateP99Us float64 `json:"redis_rate_p99_us"`

	PgrlChecks      int `json:"pgrl_checks"`
	RedisRateChecks int `json:"redis_rate_checks"`
	// PgrlStatements counts the statements pgrl sent, of which
	// PgrlBatchStatements were coalesced batches; PgrlAvgBatch is checks
	// per statement.
	PgrlStatements      int64   `json:"pgrl_statements"`
	PgrlBatchStatements int64   `json:"pgrl_batch_statements"`
	PgrlAvgBatch        float64 `json:"pgrl_avg_batch"`
	// Client CPU time (user + system) per check, and the machine's busy
	// share while each path ran.
	PgrlClientCPUUsOp  float64 `json:"pgrl_client_cpu_us_per_op"`
	RedisClientCPUUsOp float64 `json:"redis_rate_client_cpu_us_per_op"`
	// Server CPU time per check: the pool's PostgreSQL backends, from
	// /proc, and redis-server, from INFO cpu (both on this machine).
	PgrlServerCPUUsOp  float64 `json:"pgrl_server_cpu_us_per_op"`
	RedisServerCPUUsOp float64 `json:"redis_rate_server_cpu_us_per_op"`
	PgrlMachineBusy    float64 `json:"pgrl_machine_busy"`
	RedisMachineBusy   float64 `json:"redis_rate_machine_busy"`

	// Uncoalesced is pgrl with DisableCoalescing, with --compare-coalescing.
	Uncoalesced *Uncoalesced `json:"pgrl_uncoalesced,omitempty"`

	// Variants are the --variant paths: pgrl with other settings.
	Variants []Variant `json:"pgrl_variants,omitempty"`

	// Lease is what the leased limiter did, with --lease-size.
	Lease *LeaseStats `json:"pgrl_lease,omitempty"`
}

// Variant is the measurement of pgrl with other coalescing settings, in the
// same case and interleaved with the other paths.
type Variant struct {
	Name           string  `json:"name"`
	OpsPerSec      float64 `json:"ops_per_sec"`
	RatioVsRedis   float64 `json:"ratio"`
	P50Us          float64 `json:"p50_us"`
	P99Us          float64 `json:"p99_us"`
	AvgBatch       float64 `json:"avg_batch"`
	BatchStatement int64   `json:"batch_statements"`
	ClientCPUUsOp  float64 `json:"client_cpu_us_per_op"`
	ServerCPUUsOp  float64 `json:"server_cpu_us_per_op"`
}

// Uncoalesced is the measurement of pgrl with coalescing disabled, in the
// same case and interleaved with the other paths.
type Uncoalesced struct {
	OpsPerSec     float64 `json:"ops_per_sec"`
	P50Us         float64 `json:"p50_us"`
	P99Us         float64 `json:"p99_us"`
	Checks        int     `json:"checks"`
	ClientCPUUsOp float64 `json:"client_cpu_us_per_op"`
	ServerCPUUsOp float64 `json:"server_cpu_us_per_op"`
	MachineBusy   float64 `json:"machine_busy"`
	// GainOps is coalesced ops/s over uncoalesced ops/s; P50Ratio is
	// coalesced p50 over uncoalesced p50.
	GainOps  float64 `json:"coalescing_gain_ops"`
	P50Ratio float64 `json:"coalesced_p50_ratio"`
}

// MixInfo describes an application mix: where its keys come from, its
// limits and its endpoints.
type MixInfo struct {
	Name string `json:"name"`
	// Users and IPs are the populations the keys are drawn from, with a
	// Zipf skew of exponent ZipfS; Seed seeds the draw of Requests
	// requests, which the callers pick among uniformly.
	Users     int           `json:"users"`
	IPs       int           `json:"ips"`
	ZipfS     float64       `json:"zipf_s"`
	Seed      uint64        `json:"seed"`
	Requests  int           `json:"requests"`
	Limits    []MixLimit    `json:"limits"`
	Endpoints []MixEndpoint `json:"endpoints"`
	// Beacon says where each side keeps the beacon's limit.
	Beacon string `json:"beacon"`
}

// MixLimit is one limit of a mix: a token bucket of Rate per Period and
// Burst on both sides (Burst so large that every check is admitted). With
// --algorithm fixed_window or sliding_window (Report.Algorithm), pgrl counts
// Burst per window of Period instead.
type MixLimit struct {
	Name   string `json:"name"`
	Rate   int64  `json:"rate"`
	Period string `json:"period"`
	Burst  int64  `json:"burst"`
	// Memory: pgrl keeps it in process memory, not in PostgreSQL.
	Memory bool `json:"memory,omitempty"`
}

// MixEndpoint is one kind of request of a mix: its share of the requests
// and the limits it checks (several: one decision over all of them on
// pgrl's side, one call each on redis_rate's).
type MixEndpoint struct {
	Name      string   `json:"name"`
	WeightPct int      `json:"weight_pct"`
	Limits    []string `json:"limits"`
}

// MixCase is the application mix at one number of callers. A request is
// one call of an endpoint: one check, or three for a login.
type MixCase struct {
	Mix        string `json:"mix"`
	Callers    int    `json:"callers"`
	PgConns    int    `json:"pg_conns"`
	RedisConns int    `json:"redis_conns"`

	PgrlRequestsPerSec      float64 `json:"pgrl_requests_per_sec"`
	RedisRateRequestsPerSec float64 `json:"redis_rate_requests_per_sec"`
	// Ratio is pgrl's requests/s over redis_rate's.
	Ratio                 float64 `json:"ratio"`
	PgrlChecksPerSec      float64 `json:"pgrl_checks_per_sec"`
	RedisRateChecksPerSec float64 `json:"redis_rate_checks_per_sec"`
	// Latencies are per request (three checks for a login).
	PgrlP50Us      float64 `json:"pgrl_p50_us"`
	PgrlP99Us      float64 `json:"pgrl_p99_us"`
	RedisRateP50Us float64 `json:"redis_rate_p50_us"`
	RedisRateP99Us float64 `json:"redis_rate_p99_us"`

	PgrlRequests      int   `json:"pgrl_requests"`
	RedisRateRequests int   `json:"redis_rate_requests"`
	PgrlChecks        int64 `json:"pgrl_checks"`
	RedisRateChecks   int64 `json:"redis_rate_checks"`
	// PgrlPostgresChecks are the checks PostgreSQL decided: all but the
	// beacon's, which pgrl decides in memory.
	PgrlPostgresChecks int64 `json:"pgrl_postgres_checks"`
	// PgrlStatements counts the statements pgrl sent and PgrlRoundTrips the
	// round trips that carried them: a lone or coalesced check is one
	// statement in one round trip, a login one batch of four statements
	// (three checks and the all-or-nothing vote) in one round trip.
	PgrlStatements             int64   `json:"pgrl_statements"`
	PgrlRoundTrips             int64   `json:"pgrl_round_trips"`
	PgrlChecksPerStatement     float64 `json:"pgrl_checks_per_statement"`
	PgrlStatementsPerRoundTrip float64 `json:"pgrl_statements_per_round_trip"`
	// Client and server CPU time per request, as for Case.
	PgrlClientCPUUsReq  float64 `json:"pgrl_client_cpu_us_per_request"`
	RedisClientCPUUsReq float64 `json:"redis_rate_client_cpu_us_per_request"`
	PgrlServerCPUUsReq  float64 `json:"pgrl_server_cpu_us_per_request"`
	RedisServerCPUUsReq float64 `json:"redis_rate_server_cpu_us_per_request"`
	PgrlMachineBusy     float64 `json:"pgrl_machine_busy"`
	RedisMachineBusy    float64 `json:"redis_rate_machine_busy"`

	// Lease is what the leased limiters did, with --lease-size. Their
	// checks count in PgrlPostgresChecks whether a slice or a statement
	// answered them.
	Lease *LeaseStats `json:"pgrl_lease,omitempty"`
}

// Targets are the throughput ratios the comparison aims at, over key spaces
// of at least MinKeys keys.
type Targets struct {
	MinKeys int `json:"min_keys"`
	// MinRatio maps a number of callers to the least pgrl/redis_rate ratio.
	MinRatio map[int]float64 `json:"min_ratio"`
}

var defaultTargets = Targets{MinKeys: 100_000, MinRatio: map[int]float64{8: 0.5, 32: 1.0, 64: 1.0}}

// check lists the cases that miss a target.
func (t Targets) check(cases []Case) (bool, []string) {
	var misses []string
	for _, c := range cases {
		want, ok := t.MinRatio[c.Callers]
		if !ok || c.Keys < t.MinKeys {
			continue
		}
		if c.Ratio < want {
			misses = append(misses, fmt.Sprintf("%d callers, %d keys: ratio %.3f < %.2f", c.Callers, c.Keys, c.Ratio, want))
		}
	}
	return len(misses) == 0, misses
}

// apply reports whether any of the cases has a target.
func (t Targets) apply(cases []Case) bool {
	for _, c := range cases {
		if _, ok := t.MinRatio[c.Callers]; ok && c.Keys >= t.MinKeys {
			return true
		}
	}
	return false
}

// callerList is "8, 32 and 64": the numbers of callers with a target.
func (t Targets) callerList() string {
	var ns []string
	for _, n := range slices.Sorted(maps.Keys(t.MinRatio)) {
		ns = append(ns, strconv.Itoa(n))
	}
	if len(ns) < 2 {
		return strings.Join(ns, "")
	}
	return strings.Join(ns[:len(ns)-1], ", ") + " and " + ns[len(ns)-1]
}

func printJSON(w io.Writer, rep Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

func printText(w io.Writer, rep Report) error {
	m := rep.Machine
	fmt.Fprintf(w, "%s/%s, %d CPUs (%s), %s, PostgreSQL %s (wal_writer_flush_after %s, synchronous_commit %s), Redis %s\n",
		m.GOOS, m.GOARCH, m.NumCPU, m.CPUModel, m.GoVersion, m.PostgresVersion, m.WalWriterFlushAfter, m.SynchronousCommit, m.RedisVersion)
	fmt.Fprintf(w, "%s, %s, %gs per path per case\n", rep.Algorithm, rep.Limit, rep.DurationSeconds)
	if rep.LeaseSize > 0 {
		fmt.Fprintf(w, "leased (package lease, Size %d, Share %d, Idle %s): %s\n", rep.LeaseSize, rep.LeaseShare, rep.LeaseIdle, strings.Join(rep.Leased, ", "))
		if len(rep.Unleased) > 0 {
			fmt.Fprintf(w, "not leased: %s\n", strings.Join(rep.Unleased, "; "))
		}
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "callers\tkeys\tpgrl ops/s\tredis_rate ops/s\tratio\tpgrl p50 µs\tpgrl p99 µs\tredis p50 µs\tredis p99 µs\tavg batch\tuncoal. ops/s\tuncoal. p50 µs\t")
	for _, c := range rep.Cases {
		uo, up := "-", "-"
		if u := c.Uncoalesced; u != nil {
			uo, up = fmt.Sprintf("%.0f", u.OpsPerSec), fmt.Sprintf("%.1f", u.P50Us)
		}
		fmt.Fprintf(tw, "%d\t%d\t%.0f\t%.0f\t%.3f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%s\t%s\t\n",
			c.Callers, c.Keys, c.PgrlOpsPerSec, c.RedisRateOpsPerSec, c.Ratio, c.PgrlP50Us, c.PgrlP99Us,
			c.RedisRateP50Us, c.RedisRateP99Us, c.PgrlAvgBatch, uo, up)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, c := range rep.Cases {
		printLeaseLine(w, fmt.Sprintf("%d callers, %d keys", c.Callers, c.Keys), c.Lease, c.PgrlClientCPUUsOp, c.RedisClientCPUUsOp, "check")
	}
	if err := printMixText(w, rep); err != nil {
		return err
	}
	if rep.TargetsMet && !rep.Targets.apply(rep.Cases) {
		_, err := fmt.Fprintf(w, "\nno targets apply (they are for %d keys or more at %s callers)\n", rep.Targets.MinKeys, rep.Targets.callerList())
		return err
	}
	if rep.TargetsMet {
		_, err := fmt.Fprintln(w, "\ntargets met")
		return err
	}
	fmt.Fprintln(w, "\ntargets missed:")
	for _, m := range rep.TargetMisses {
		fmt.Fprintf(w, "  %s\n", m)
	}
	return nil
}

// printMixText prints the mix cases, when there are any.
func printMixText(w io.Writer, rep Report) error {
	if len(rep.MixCases) == 0 || rep.Mix == nil {
		return nil
	}
	m := rep.Mix
	fmt.Fprintf(w, "\napplication mix %q: %d users, %d IPs, Zipf s=%g, %d requests drawn (seed %d); %s\n",
		m.Name, m.Users, m.IPs, m.ZipfS, m.Requests, m.Seed, m.endpointSummary())
	fmt.Fprintf(w, "login: 3 limits in one AllowAll (pgrl), 3 Allow calls (redis_rate); beacon: %s\n\n", m.Beacon)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "callers\tpgrl req/s\tredis_rate req/s\tratio\tpgrl checks/s\tredis_rate checks/s\tpgrl p50 µs\tpgrl p99 µs\tredis p50 µs\tredis p99 µs\tchecks/stmt\tstmts/round trip\t")
	for _, c := range rep.MixCases {
		fmt.Fprintf(tw, "%d\t%.0f\t%.0f\t%.3f\t%.0f\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t\n",
			c.Callers, c.PgrlRequestsPerSec, c.RedisRateRequestsPerSec, c.Ratio, c.PgrlChecksPerSec, c.RedisRateChecksPerSec,
			c.PgrlP50Us, c.PgrlP99Us, c.RedisRateP50Us, c.RedisRateP99Us, c.PgrlChecksPerStatement, c.PgrlStatementsPerRoundTrip)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, c := range rep.MixCases {
		printLeaseLine(w, fmt.Sprintf("mix, %d callers", c.Callers), c.Lease, c.PgrlClientCPUUsReq, c.RedisClientCPUUsReq, "request")
	}
	return nil
}

// printLeaseLine prints what a case's leased limiters did, with the client
// CPU per check or request of both sides; nothing for an unleased case.
func printLeaseLine(w io.Writer, what string, s *LeaseStats, pgCPU, redisCPU float64, unit string) {
	if s == nil {
		return
	}
	verdict := "never over the limit: held"
	if !s.NeverOverLimit {
		verdict = "never over the limit: NOT shown"
	}
	fmt.Fprintf(w, "lease, %s: %d slices, %d units leased (%d used, %d returned, %d dropped), %d local and %d database decisions (%.4f database decisions per leased check), %d admitted, %s; client CPU µs per %s: pgrl %.2f, redis_rate %.2f\n",
		what, s.Slices, s.UnitsLeased, s.UsedLocally, s.Returned, s.Dropped, s.LocalDecisions, s.DatabaseDecisions,
		s.DatabaseDecisionsPerCheck(), s.Admitted, verdict, unit, pgCPU, redisCPU)
}
