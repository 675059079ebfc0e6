// Package otelpgrl exports what pgrl's limiters do through OpenTelemetry:
// metrics through go.opentelemetry.io/otel/metric, and a check's decision
// as attributes of the caller's span.
//
// It is a module of its own, so that pgrl's core module carries no
// OpenTelemetry, and it imports only OpenTelemetry's API: the application
// brings the SDK and its exporters, and passes its MeterProvider.
//
//	obs, err := otelpgrl.NewObserver(otel.GetMeterProvider())
//	...
//	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Observer: obs})
//
// The names follow the nearest stable convention, ASP.NET Core's rate
// limiting metrics (aspnetcore.rate_limiting.*), in pgrl's namespace (see
// docs/METRICS.md):
//
//   - pgrl.rate_limiting.requests (counter, {request}): checks, by
//     pgrl.rate_limiting.policy (the limiter's name),
//     pgrl.rate_limiting.result (acquired, denied, shadow_denied,
//     not_counted, error) and pgrl.rate_limiting.store (postgres, memory,
//     deny_cache, policy, none).
//   - pgrl.rate_limiting.request.duration (histogram, s): how long checks
//     took, by policy and store.
//   - pgrl.rate_limiting.fallbacks (counter, {request}): checks answered
//     without the database while it failed (store memory or policy), by
//     policy and store.
//   - pgrl.rate_limiting.breaker.open (gauge, 1 or 0): whether the
//     limiter's circuit breaker keeps checks away from the database.
//   - pgrl.rate_limiting.deny_cache.hits (counter, {request}): checks the
//     local deny cache answered.
//
// RegisterPolicy, RegisterShares and RegisterLeases add observable
// instruments for a policy listener and its cache, for shared denials and
// for lease limiters, read at each collection.
package otelpgrl

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgrl/pgrl/ratelimit"
)

// ScopeName is the instrumentation scope of the meters this package
// creates.
const ScopeName = "github.com/pgrl/pgrl/otelpgrl"

// Instrument names.
const (
	Requests        = "pgrl.rate_limiting.requests"
	RequestDuration = "pgrl.rate_limiting.request.duration"
	Fallbacks       = "pgrl.rate_limiting.fallbacks"
	BreakerOpen     = "pgrl.rate_limiting.breaker.open"
	DenyCacheHits   = "pgrl.rate_limiting.deny_cache.hits"
)

// Attribute keys.
const (
	// AttrPolicy is the limiter's name (ratelimit.Config.Name), as
	// aspnetcore.rate_limiting.policy names the policy that applied.
	AttrPolicy = attribute.Key("pgrl.rate_limiting.policy")
	// AttrResult is what became of the check: ResultAcquired,
	// ResultDenied, ...; aspnetcore.rate_limiting.result's "acquired" is
	// kept, its reasons for a rejection are pgrl's.
	AttrResult = attribute.Key("pgrl.rate_limiting.result")
	// AttrStore is what answered (ratelimit.Store), or StoreNone for an
	// error.
	AttrStore = attribute.Key("pgrl.rate_limiting.store")
)

// Values of AttrResult.
const (
	ResultAcquired     = "acquired"
	ResultDenied       = "denied"
	ResultShadowDenied = "shadow_denied"
	// ResultNotCounted is a check of a ratelimit.AllowAll decision under
	// AllOrNothing that its own limit allowed while another denied:
	// refused, and nothing counted.
	ResultNotCounted = "not_counted"
	ResultError      = "error"
)

// StoreNone is AttrStore of a check that returned an error.
const StoreNone = "none"

// DurationBuckets are the request-duration histogram's bucket boundaries,
// in seconds: from 100 µs (a round trip on a local network) to 2.5 s (a
// database in trouble), as package metrics has them.
var DurationBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}

// Observer records limiter decisions as OpenTelemetry metrics. It
// implements ratelimit.Observer and is safe for concurrent use; share one
// between the limiters of a MeterProvider.
type Observer struct {
	requests  metric.Int64Counter
	duration  metric.Float64Histogram
	fallbacks metric.Int64Counter
	breaker   metric.Int64Gauge
	denyHits  metric.Int64Counter
}

var _ ratelimit.Observer = (*Observer)(nil)

// NewObserver creates the instruments with a meter of mp (scope
// ScopeName).
func NewObserver(mp metric.MeterProvider) (*Observer, error) {
	m := mp.Meter(ScopeName)
	var o Observer
	var err error
	if o.requests, err = m.Int64Counter(Requests, metric.WithUnit("{request}"),
		metric.WithDescription("Rate-limit checks, by policy (limiter name), result and the store that answered.")); err != nil {
		return nil, err
	}
	if o.duration, err = m.Float64Histogram(RequestDuration, metric.WithUnit("s"),
		metric.WithDescription("Time taken by rate-limit checks, by policy and the store that answered."),
		metric.WithExplicitBucketBoundaries(DurationBuckets...)); err != nil {
		return nil, err
	}
	if o.fallbacks, err = m.Int64Counter(Fallbacks, metric.WithUnit("{request}"),
		metric.WithDescription("Checks answered without the database while it failed: by the in-process memory tier (store memory) or the failure policy (store policy).")); err != nil {
		return nil, err
	}
	if o.breaker, err = m.Int64Gauge(BreakerOpen, metric.WithUnit("1"),
		metric.WithDescription("1 while the limiter's circuit breaker keeps checks away from the database, else 0.")); err != nil {
		return nil, err
	}
	if o.denyHits, err = m.Int64Counter(DenyCacheHits, metric.WithUnit("{request}"),
		metric.WithDescription("Checks answered by the limiter's local deny cache, without a database round trip.")); err != nil {
		return nil, err
	}
	return &o, nil
}

// Result is AttrResult's value for a check's decision and error.
func Result(d ratelimit.Decision, err error) string {
	switch {
	case err != nil:
		return ResultError
	case d.ShadowDenied:
		return ResultShadowDenied
	case !d.Allowed:
		return ResultDenied
	case d.Granted == 0:
		return ResultNotCounted
	}
	return ResultAcquired
}

// store is AttrStore's value.
func store(d ratelimit.Decision, err error) string {
	if err != nil || d.Store == "" {
		return StoreNone
	}
	return string(d.Store)
}

// ObserveDecision implements ratelimit.Observer.
func (o *Observer) ObserveDecision(limiter string, d ratelimit.Decision, took time.Duration, err error) {
	ctx := context.Background()
	st := store(d, err)
	o.requests.Add(ctx, 1, metric.WithAttributes(AttrPolicy.String(limiter), AttrResult.String(Result(d, err)),
		AttrStore.String(st)))
	by := metric.WithAttributes(AttrPolicy.String(limiter), AttrStore.String(st))
	o.duration.Record(ctx, took.Seconds(), by)
	if err != nil {
		return
	}
	switch d.Store {
	case ratelimit.StoreMemory, ratelimit.StorePolicy:
		// A MemoryLimiter's own decisions are memory's too, without a
		// Reason: only a failure makes one.
		if d.Reason != "" {
			o.fallbacks.Add(ctx, 1, by)
		}
	case ratelimit.StoreDenyCache:
		o.denyHits.Add(ctx, 1, metric.WithAttributes(AttrPolicy.String(limiter)))
	}
}

// ObserveBreaker implements ratelimit.Observer.
func (o *Observer) ObserveBreaker(limiter string, open bool) {
	v := int64(0)
	if open {
		v = 1
	}
	o.breaker.Record(context.Background(), v, metric.WithAttributes(AttrPolicy.String(limiter)))
}
