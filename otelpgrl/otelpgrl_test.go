package otelpgrl_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/otelpgrl"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// collect reads everything reader holds, by instrument name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, otelpgrl.ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			out[m.Name] = m.Data
		}
	}
	return out
}

// sum is the value of the data point of a sum whose attributes include
// every one of want; 0 when there is none.
func sum(t *testing.T, data metricdata.Aggregation, want ...attribute.KeyValue) int64 {
	t.Helper()
	var pts []metricdata.DataPoint[int64]
	switch d := data.(type) {
	case metricdata.Sum[int64]:
		pts = d.DataPoints
	case metricdata.Gauge[int64]:
		pts = d.DataPoints
	case nil:
		return 0
	default:
		t.Fatalf("unexpected aggregation %T", data)
	}
	total := int64(0)
	for _, p := range pts {
		match := true
		for _, kv := range want {
			if v, ok := p.Attributes.Value(kv.Key); !ok || v != kv.Value {
				match = false
			}
		}
		if match {
			total += p.Value
		}
	}
	return total
}

func newMeter() (*sdkmetric.ManualReader, *sdkmetric.MeterProvider) {
	reader := sdkmetric.NewManualReader()
	return reader, sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
}

// Decisions are counted by policy, result and store; their durations
// recorded; deny-cache answers counted as hits.
func TestObserverCountsDecisions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := dbtest.Pool(t)
	reader, mp := newMeter()
	obs, err := otelpgrl.NewObserver(mp)
	require.NoError(t, err)
	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "api", Algorithm: ratelimit.FixedWindow, Limit: 2,
		Window: time.Hour}, ratelimit.DatabaseOptions{Observer: obs})
	for range 4 {
		_, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
	}
	_, err = lim.Allow(ctx, "k", ratelimit.Cost(-1))
	require.Error(t, err)

	m := collect(t, reader)
	policyAttr := otelpgrl.AttrPolicy.String("api")
	require.EqualValues(t, 2, sum(t, m[otelpgrl.Requests], policyAttr, otelpgrl.AttrResult.String("acquired"),
		otelpgrl.AttrStore.String("postgres")))
	require.EqualValues(t, 1, sum(t, m[otelpgrl.Requests], otelpgrl.AttrResult.String("denied"),
		otelpgrl.AttrStore.String("postgres")))
	require.EqualValues(t, 1, sum(t, m[otelpgrl.Requests], otelpgrl.AttrResult.String("denied"),
		otelpgrl.AttrStore.String("deny_cache")), "the second denial, from the deny cache")
	require.EqualValues(t, 1, sum(t, m[otelpgrl.Requests], otelpgrl.AttrResult.String("error"),
		otelpgrl.AttrStore.String("none")))
	require.EqualValues(t, 1, sum(t, m[otelpgrl.DenyCacheHits], policyAttr))
	require.Zero(t, sum(t, m[otelpgrl.Fallbacks]))
	h, ok := m[otelpgrl.RequestDuration].(metricdata.Histogram[float64])
	require.True(t, ok)
	var n uint64
	for _, p := range h.DataPoints {
		n += p.Count
		require.Equal(t, otelpgrl.DurationBuckets, p.Bounds)
	}
	require.EqualValues(t, 5, n)
}

// A database that does not answer: the memory tier answers, counted as
// fallbacks, and the breaker's gauge goes to 1 when it opens.
func TestObserverCountsFallbacksAndBreaker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	reader, mp := newMeter()
	obs, err := otelpgrl.NewObserver(mp)
	require.NoError(t, err)
	lim := testkit.NewLimiter(t, testkit.DeadPool(t), ratelimit.Config{Name: "api", Limit: 10, Window: time.Minute,
		OnFailure: ratelimit.FailToMemory}, ratelimit.DatabaseOptions{Observer: obs, BreakerThreshold: 2,
		Timeout: time.Second})
	for range 3 {
		d, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StoreMemory, d.Store)
	}
	m := collect(t, reader)
	require.EqualValues(t, 3, sum(t, m[otelpgrl.Fallbacks], otelpgrl.AttrStore.String("memory")))
	require.EqualValues(t, 1, sum(t, m[otelpgrl.BreakerOpen], otelpgrl.AttrPolicy.String("api")))

	// A MemoryLimiter's own decisions are not fallbacks.
	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "mem", Limit: 1, Window: time.Minute},
		ratelimit.MemoryOptions{})
	require.NoError(t, err)
	d, err := mem.Allow(ctx, "k")
	require.NoError(t, err)
	obs.ObserveDecision("mem", d, time.Microsecond, nil)
	require.Zero(t, sum(t, collect(t, reader)[otelpgrl.Fallbacks], otelpgrl.AttrPolicy.String("mem")))
}

// Annotate puts a decision on the caller's span; an error's outcome too.
func TestAnnotate(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, span := tp.Tracer("test").Start(context.Background(), "request")
	otelpgrl.Annotate(ctx, "api", ratelimit.Decision{Allowed: false, Limit: 10, RetryAfter: 1500 * time.Millisecond,
		Store: ratelimit.StorePostgres}, nil)
	span.End()
	ctx2, span2 := tp.Tracer("test").Start(context.Background(), "failed")
	otelpgrl.Annotate(ctx2, "api", ratelimit.Decision{},
		ratelimit.WithOutcome(errors.New("connection reset"), ratelimit.OutcomeUnknown))
	span2.End()
	// No span in the context: nothing, and no panic.
	otelpgrl.Annotate(context.Background(), "api", ratelimit.Decision{}, nil)

	spans := rec.Ended()
	require.Len(t, spans, 2)
	got := attribute.NewSet(spans[0].Attributes()...)
	for _, kv := range []attribute.KeyValue{otelpgrl.AttrPolicy.String("api"), otelpgrl.AttrResult.String("denied"),
		otelpgrl.AttrStore.String("postgres"), otelpgrl.AttrLimit.Int64(10), otelpgrl.AttrRetryAfter.Float64(1.5)} {
		v, ok := got.Value(kv.Key)
		require.True(t, ok, kv.Key)
		require.Equal(t, kv.Value, v, kv.Key)
	}
	failed := attribute.NewSet(spans[1].Attributes()...)
	v, _ := failed.Value(otelpgrl.AttrResult)
	require.Equal(t, "error", v.AsString())
	v, _ = failed.Value(otelpgrl.AttrErrorOutcome)
	require.Equal(t, ratelimit.OutcomeUnknown.String(), v.AsString())
}

// The observable instruments read a policy listener and its cache, shared
// denials and lease limiters at each collection.
func TestRegisterObservables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	reader, mp := newMeter()

	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Algorithm: ratelimit.FixedWindow, Limit: 100,
		Window: time.Minute})
	require.NoError(t, err)
	cache := policy.NewCache(pool)
	l, err := policy.Watch(ctx, dbtest.URLWithSchema(s), cache, policy.ListenerOptions{})
	require.NoError(t, err)
	defer func() { _ = l.Close() }()
	require.NoError(t, l.WaitSynced(ctx))
	reg, err := otelpgrl.RegisterPolicy(mp, l, cache)
	require.NoError(t, err)
	defer func() { _ = reg.Unregister() }()

	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "shared", Algorithm: ratelimit.FixedWindow, Limit: 1,
		Window: time.Hour, ShareDenials: true})
	_, err = otelpgrl.RegisterShares(mp, lim)
	require.NoError(t, err)
	for range 2 {
		_, err := lim.Allow(ctx, "k")
		require.NoError(t, err)
	}

	base := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "leased", Algorithm: ratelimit.FixedWindow,
		Limit: 1000, Window: time.Hour})
	x, err := lease.New(base, lease.Options{Size: 10})
	require.NoError(t, err)
	defer func() { _ = x.Close(ctx) }()
	_, err = otelpgrl.RegisterLeases(mp, x)
	require.NoError(t, err)
	for range 5 {
		_, err := x.Allow(ctx, "k")
		require.NoError(t, err)
	}

	require.Eventually(t, func() bool {
		return sum(t, collect(t, reader)[otelpgrl.SharedDenials], otelpgrl.AttrKind.String("sent")) == 1
	}, 10*time.Second, 20*time.Millisecond, "the denial was shared")
	m := collect(t, reader)
	require.EqualValues(t, 1, sum(t, m[otelpgrl.PolicyConnected]))
	require.EqualValues(t, 1, sum(t, m[otelpgrl.PolicyCached], otelpgrl.AttrKind.String("policy")))
	require.Positive(t, sum(t, m[otelpgrl.PolicyResyncs]))
	// What the lease limiter's Stats say, by instrument: five checks,
	// answered from slices or by the statements that took them.
	st := x.Stats()
	name := otelpgrl.AttrPolicy.String("leased")
	require.Positive(t, st.Slices)
	require.Equal(t, st.Slices, sum(t, m[otelpgrl.LeaseSlices], name))
	require.Equal(t, st.Leased, sum(t, m[otelpgrl.LeaseUnits], name, otelpgrl.AttrKind.String("leased")))
	require.Equal(t, st.UsedLocally, sum(t, m[otelpgrl.LeaseUnits], name, otelpgrl.AttrKind.String("used")))
	require.Equal(t, st.LocalDecisions, sum(t, m[otelpgrl.LeaseDecisions], name, otelpgrl.AttrStore.String("lease")))
	require.EqualValues(t, 5, sum(t, m[otelpgrl.LeaseDecisions], name))
	require.Positive(t, st.LocalDecisions, "some checks were answered from a slice")
}
