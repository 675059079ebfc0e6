package otelpgrl

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// Names of the observable instruments, read at each collection.
const (
	PolicyNotifications = "pgrl.policy.notifications"
	PolicyConnected     = "pgrl.policy.listener.connected"
	PolicyReconnects    = "pgrl.policy.listener.reconnects"
	PolicyResyncs       = "pgrl.policy.cache.resyncs"
	PolicyCached        = "pgrl.policy.cache.entries"
	SharedDenials       = "pgrl.rate_limiting.shared_denials"
	LeaseUnits          = "pgrl.lease.units"
	LeaseSlices         = "pgrl.lease.slices"
	LeaseDecisions      = "pgrl.lease.decisions"
)

// AttrOutcome, AttrKind and AttrLease qualify the observable instruments.
const (
	AttrOutcome = attribute.Key("pgrl.outcome")
	AttrKind    = attribute.Key("pgrl.kind")
	AttrLease   = attribute.Key("pgrl.lease")
)

// RegisterPolicy observes a policy.Listener and its Cache through a meter
// of mp: notifications by outcome (applied, ignored, dropped), whether the
// listener is connected, its reconnects, the cache's full reloads, and its
// entries by kind (policy, override). Unregister the returned registration
// when the listener is closed.
func RegisterPolicy(mp metric.MeterProvider, l *policy.Listener, c *policy.Cache) (metric.Registration, error) {
	m := mp.Meter(ScopeName)
	notes, err := m.Int64ObservableCounter(PolicyNotifications, metric.WithUnit("{notification}"),
		metric.WithDescription("Policy change notifications, by outcome: applied, ignored (another schema's), dropped (a reload failed)."))
	if err != nil {
		return nil, err
	}
	connected, err := m.Int64ObservableGauge(PolicyConnected, metric.WithUnit("1"),
		metric.WithDescription("1 while the policy listener is connected and listening, else 0."))
	if err != nil {
		return nil, err
	}
	reconnects, err := m.Int64ObservableCounter(PolicyReconnects, metric.WithUnit("{connection}"),
		metric.WithDescription("Connections the policy listener made after its first; each is followed by a full reload."))
	if err != nil {
		return nil, err
	}
	resyncs, err := m.Int64ObservableCounter(PolicyResyncs, metric.WithUnit("{reload}"),
		metric.WithDescription("Full reloads of the policy cache, the first included."))
	if err != nil {
		return nil, err
	}
	cached, err := m.Int64ObservableGauge(PolicyCached, metric.WithUnit("{entry}"),
		metric.WithDescription("Entries of the policy cache, by kind: policy, override."))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := l.Stats()
		o.ObserveInt64(notes, int64(s.Applied), metric.WithAttributes(AttrOutcome.String("applied")))
		o.ObserveInt64(notes, int64(s.Ignored), metric.WithAttributes(AttrOutcome.String("ignored")))
		o.ObserveInt64(notes, int64(s.Dropped), metric.WithAttributes(AttrOutcome.String("dropped")))
		up := int64(0)
		if s.Connected {
			up = 1
		}
		o.ObserveInt64(connected, up)
		o.ObserveInt64(reconnects, int64(s.Reconnects))
		o.ObserveInt64(resyncs, int64(s.Resyncs))
		policies, overrides := c.Size()
		o.ObserveInt64(cached, int64(policies), metric.WithAttributes(AttrKind.String("policy")))
		o.ObserveInt64(cached, int64(overrides), metric.WithAttributes(AttrKind.String("override")))
		return nil
	}, notes, connected, reconnects, resyncs, cached)
}

// Sharer is a limiter that shares its denials with other processes
// (ratelimit.Config.ShareDenials): a *ratelimit.Limiter or a package
// policy *Limiter.
type Sharer interface {
	ShareStats() ratelimit.ShareStats
	Config() ratelimit.Config
}

var (
	_ Sharer = (*ratelimit.Limiter)(nil)
	_ Sharer = (*policy.Limiter)(nil)
)

// RegisterShares observes the shared denials of limiters through a meter
// of mp, by limiter (AttrPolicy) and kind: sent, dropped, failed (marks
// this process published or could not), received, refused (marks it took
// into its deny cache or refused) and answered (checks a received mark
// answered).
func RegisterShares(mp metric.MeterProvider, limiters ...Sharer) (metric.Registration, error) {
	m := mp.Meter(ScopeName)
	shared, err := m.Int64ObservableCounter(SharedDenials, metric.WithUnit("{denial}"),
		metric.WithDescription("Denials shared between processes, by limiter and kind: sent, dropped, failed, received, refused, answered."))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, l := range limiters {
			s := l.ShareStats()
			name := AttrPolicy.String(l.Config().Name)
			for _, kv := range []struct {
				kind string
				n    uint64
			}{{"sent", s.Sent}, {"dropped", s.Dropped}, {"failed", s.Failed}, {"received", s.Received},
				{"refused", s.Refused}, {"answered", s.Answered}} {
				o.ObserveInt64(shared, int64(kv.n), metric.WithAttributes(name, AttrKind.String(kv.kind)))
			}
		}
		return nil
	}, shared)
}

// RegisterLeases observes lease limiters (package lease) through a meter of
// mp, by limiter (AttrPolicy): slices taken; units by kind (leased,
// used, returned, dropped); and decisions by what answered them (lease,
// postgres, other).
func RegisterLeases(mp metric.MeterProvider, leases ...*lease.Limiter) (metric.Registration, error) {
	m := mp.Meter(ScopeName)
	slices, err := m.Int64ObservableCounter(LeaseSlices, metric.WithUnit("{slice}"),
		metric.WithDescription("Statements that took a slice of a key's quota."))
	if err != nil {
		return nil, err
	}
	units, err := m.Int64ObservableCounter(LeaseUnits, metric.WithUnit("{unit}"),
		metric.WithDescription("Leased units, by kind: leased, used (given to checks), returned, dropped."))
	if err != nil {
		return nil, err
	}
	decisions, err := m.Int64ObservableCounter(LeaseDecisions, metric.WithUnit("{request}"),
		metric.WithDescription("Checks of lease limiters, by what answered: lease (a slice, no statement), postgres, other."))
	if err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, x := range leases {
			s := x.Stats()
			name := AttrPolicy.String(x.Config().Name)
			o.ObserveInt64(slices, s.Slices, metric.WithAttributes(name))
			for _, kv := range []struct {
				kind string
				n    int64
			}{{"leased", s.Leased}, {"used", s.UsedLocally}, {"returned", s.Returned}, {"dropped", s.Dropped}} {
				o.ObserveInt64(units, kv.n, metric.WithAttributes(name, AttrKind.String(kv.kind)))
			}
			for _, kv := range []struct {
				store string
				n     int64
			}{{"lease", s.LocalDecisions}, {"postgres", s.DatabaseDecisions}, {"other", s.OtherDecisions}} {
				o.ObserveInt64(decisions, kv.n, metric.WithAttributes(name, AttrStore.String(kv.store)))
			}
		}
		return nil
	}, slices, units, decisions)
}
