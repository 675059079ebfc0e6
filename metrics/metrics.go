// Package metrics exports what pgrl does as Prometheus metrics: the
// decisions, check latency, breaker state and deny-cache hits of the
// limiters of package ratelimit, the state of a package policy listener
// and its cache, and the slices, units and decisions of package lease's
// limiters.
//
// It sits above those packages and nothing in pgrl imports it, so
// only applications that import it link the Prometheus client.
//
// Register the collectors with the registry your /metrics handler serves
// (prometheus.DefaultRegisterer when the registry passed is nil). A
// Collector implements ratelimit.Observer: create one per registry and set
// it as the Observer of every limiter; the limiter's name becomes the
// "limiter" label. A PolicyCollector reads a policy.Listener and its Cache
// at each scrape:
//
//	reg := prometheus.NewRegistry()
//	col, err := metrics.New(reg)
//	...
//	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Observer: col})
//	...
//	lim, err := limits.Limiter(ratelimit.Config{Name: "api", ...})
//	col.Init("api") // optional: the per-limiter series exist at zero before the first check
//	...
//	l, err := policy.Watch(ctx, listenerURL, cache, policy.ListenerOptions{})
//	...
//	_, err = metrics.NewPolicyCollector(reg, l, cache)
//	...
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// Registering a second Collector or PolicyCollector with the same registry
// fails: the metric names are taken. Share one Collector between all
// limiters.
//
// The series of a Collector (documented with their labels in
// docs/METRICS.md):
//
//   - pgrl_decisions_total{limiter, outcome, store}: checks by outcome
//     (allowed, denied, shadow_denied, not_counted, error) and by what answered them
//     (postgres, memory, deny_cache, policy; none for errors).
//   - pgrl_check_duration_seconds{limiter, store}: how long checks took.
//   - pgrl_breaker_open{limiter}: 1 while the limiter's breaker keeps checks
//     away from the database, else 0.
//   - pgrl_deny_cache_hits_total{limiter}: checks the local deny cache
//     answered without a round trip.
//
// A PolicyCollector exports the pgrl_policy_* series (see PolicyCollector),
// a LeaseCollector the pgrl_lease_* series of lease limiters, read from
// their Stats at each scrape (see LeaseCollector):
//
//	lc, err := metrics.NewLeaseCollector(reg, leased)
//
// Events (the breaker opening and closing, outages) are logged by the
// limiters themselves through their Database's logger
// (ratelimit.DatabaseOptions.Logger, log/slog); the
// Collector only counts.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgrl/pgrl/ratelimit"
)

// Metric names.
const (
	DecisionsTotal     = "pgrl_decisions_total"
	CheckDuration      = "pgrl_check_duration_seconds"
	BreakerOpen        = "pgrl_breaker_open"
	DenyCacheHitsTotal = "pgrl_deny_cache_hits_total"
)

// Values of the outcome label.
const (
	OutcomeAllowed      = "allowed"
	OutcomeDenied       = "denied"
	OutcomeShadowDenied = "shadow_denied"
	OutcomeError        = "error"
	// OutcomeNotCounted is a check of a ratelimit.AllowAll decision under
	// AllOrNothing that its own limit would have allowed, while another
	// limit of the decision denied: the request was refused and nothing
	// was counted (Decision.Allowed with Granted 0).
	OutcomeNotCounted = "not_counted"
)

// StoreNone is the store label of a check that returned an error.
const StoreNone = "none"

// DurationBuckets are the check-duration histogram's upper bounds, in
// seconds: from 100 µs (a check's round trip on a local network is about
// that) to 2.5 s (a database in trouble).
var DurationBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}

// Collector counts limiter decisions into Prometheus metrics. It implements
// ratelimit.Observer and is safe for concurrent use.
type Collector struct {
	decisions *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	breaker   *prometheus.GaugeVec
	denyHits  *prometheus.CounterVec
}

var _ ratelimit.Observer = (*Collector)(nil)

// New creates the metrics and registers them with reg
// (prometheus.DefaultRegisterer when nil). It fails when reg already holds
// metrics of the same names, for instance a second Collector: share one
// Collector between all limiters instead.
func New(reg prometheus.Registerer) (*Collector, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	c := &Collector{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DecisionsTotal,
			Help: "Rate-limit checks, by limiter, outcome (allowed, denied, shadow_denied, not_counted, error) and the store that answered (postgres, memory, deny_cache, policy; none for errors).",
		}, []string{"limiter", "outcome", "store"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    CheckDuration,
			Help:    "Time taken by rate-limit checks, by limiter and the store that answered.",
			Buckets: DurationBuckets,
		}, []string{"limiter", "store"}),
		breaker: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: BreakerOpen,
			Help: "1 while the limiter's circuit breaker keeps checks away from the database, else 0.",
		}, []string{"limiter"}),
		denyHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: DenyCacheHitsTotal,
			Help: "Checks answered by the limiter's local deny cache, without a database round trip.",
		}, []string{"limiter"}),
	}
	for _, m := range []prometheus.Collector{c.decisions, c.duration, c.breaker, c.denyHits} {
		if err := reg.Register(m); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Init creates the per-limiter series at zero (breaker closed, no deny
// cache hits) for the named limiters, so that dashboards and alerts see
// them before the first event. Optional.
func (c *Collector) Init(limiters ...string) {
	for _, l := range limiters {
		c.breaker.WithLabelValues(l).Set(0)
		c.denyHits.WithLabelValues(l)
	}
}

// ObserveDecision implements ratelimit.Observer.
func (c *Collector) ObserveDecision(limiter string, d ratelimit.Decision, took time.Duration, err error) {
	store, outcome := string(d.Store), OutcomeAllowed
	switch {
	case err != nil:
		store, outcome = StoreNone, OutcomeError
	case d.ShadowDenied:
		outcome = OutcomeShadowDenied
	case !d.Allowed:
		outcome = OutcomeDenied
	case d.Granted == 0:
		outcome = OutcomeNotCounted
	}
	if store == "" {
		store = StoreNone
	}
	c.decisions.WithLabelValues(limiter, outcome, store).Inc()
	c.duration.WithLabelValues(limiter, store).Observe(took.Seconds())
	if err == nil && d.Store == ratelimit.StoreDenyCache {
		c.denyHits.WithLabelValues(limiter).Inc()
	}
}

// ObserveBreaker implements ratelimit.Observer.
func (c *Collector) ObserveBreaker(limiter string, open bool) {
	v := 0.0
	if open {
		v = 1
	}
	c.breaker.WithLabelValues(limiter).Set(v)
}
