package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgrl/pgrl/policy"
)

// Metric names of a policy listener and its cache (package policy).
const (
	PolicyNotificationsTotal = "pgrl_policy_notifications_total"
	PolicyReconnectsTotal    = "pgrl_policy_listener_reconnects_total"
	PolicyResyncsTotal       = "pgrl_policy_listener_resyncs_total"
	PolicyListenerConnected  = "pgrl_policy_listener_connected"
	PolicyCachePolicies      = "pgrl_policy_cache_policies"
	PolicyCacheOverrides     = "pgrl_policy_cache_overrides"
	PolicyCacheLoaded        = "pgrl_policy_cache_loaded_timestamp_seconds"
	PolicyDenialsTotal       = "pgrl_policy_shared_denials_total"
)

// PolicyCollector exports a policy.Listener's counters and its Cache's size
// as Prometheus metrics, read at each scrape:
//
//   - pgrl_policy_notifications_total{outcome}: notifications applied,
//     ignored (another schema's) and dropped (a reload failed: a full
//     reload follows);
//   - pgrl_policy_listener_reconnects_total and
//     pgrl_policy_listener_resyncs_total: connections after the first, and
//     full reloads;
//   - pgrl_policy_listener_connected: 1 while the listener is listening;
//   - pgrl_policy_cache_policies, pgrl_policy_cache_overrides: what the
//     cache holds;
//   - pgrl_policy_cache_loaded_timestamp_seconds: the last full reload;
//   - pgrl_policy_shared_denials_total{outcome}: with
//     policy.ListenerOptions.Denials, the denials shared by other processes:
//     applied (a registered limiter kept the mark), refused, unknown (no
//     limiter of that name registered), other_schema, invalid (unreadable
//     payload) and dropped (they arrived faster than they could be handed
//     out).
//
// Alert on pgrl_policy_listener_connected == 0 for longer than a minute:
// limits changed meanwhile are not applied until it reconnects.
type PolicyCollector struct {
	listener *policy.Listener
	cache    *policy.Cache
	notes    *prometheus.Desc
	reconn   *prometheus.Desc
	resyncs  *prometheus.Desc
	conn     *prometheus.Desc
	policies *prometheus.Desc
	overr    *prometheus.Desc
	loaded   *prometheus.Desc
	denials  *prometheus.Desc
}

// NewPolicyCollector creates the collector of l and its cache c and
// registers it with reg (prometheus.DefaultRegisterer when nil).
func NewPolicyCollector(reg prometheus.Registerer, l *policy.Listener, c *policy.Cache) (*PolicyCollector, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	pc := &PolicyCollector{
		listener: l, cache: c,
		notes: prometheus.NewDesc(PolicyNotificationsTotal,
			"Policy change notifications, by outcome: applied, ignored (another schema's), dropped (a reload failed; a full reload follows).",
			[]string{"outcome"}, nil),
		reconn:   prometheus.NewDesc(PolicyReconnectsTotal, "Connections the policy listener made after its first.", nil, nil),
		resyncs:  prometheus.NewDesc(PolicyResyncsTotal, "Full reloads of the policy cache by the listener.", nil, nil),
		conn:     prometheus.NewDesc(PolicyListenerConnected, "1 while the policy listener is connected and listening, else 0.", nil, nil),
		policies: prometheus.NewDesc(PolicyCachePolicies, "Policies in the in-process cache.", nil, nil),
		overr:    prometheus.NewDesc(PolicyCacheOverrides, "Per-key overrides in the in-process cache.", nil, nil),
		loaded:   prometheus.NewDesc(PolicyCacheLoaded, "Unix time of the cache's last full reload (0 before the first).", nil, nil),
		denials: prometheus.NewDesc(PolicyDenialsTotal,
			"Denials shared by other processes, by outcome: applied, refused, unknown (no such limiter registered), other_schema, invalid, dropped (arrived faster than handed out).",
			[]string{"outcome"}, nil),
	}
	if err := reg.Register(pc); err != nil {
		return nil, err
	}
	return pc, nil
}

// Describe implements prometheus.Collector.
func (pc *PolicyCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{pc.notes, pc.reconn, pc.resyncs, pc.conn, pc.policies, pc.overr, pc.loaded, pc.denials} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (pc *PolicyCollector) Collect(ch chan<- prometheus.Metric) {
	st := pc.listener.Stats()
	ch <- prometheus.MustNewConstMetric(pc.notes, prometheus.CounterValue, float64(st.Applied), "applied")
	ch <- prometheus.MustNewConstMetric(pc.notes, prometheus.CounterValue, float64(st.Ignored), "ignored")
	ch <- prometheus.MustNewConstMetric(pc.notes, prometheus.CounterValue, float64(st.Dropped), "dropped")
	ch <- prometheus.MustNewConstMetric(pc.reconn, prometheus.CounterValue, float64(st.Reconnects))
	ch <- prometheus.MustNewConstMetric(pc.resyncs, prometheus.CounterValue, float64(st.Resyncs))
	connected := 0.0
	if st.Connected {
		connected = 1
	}
	ch <- prometheus.MustNewConstMetric(pc.conn, prometheus.GaugeValue, connected)
	ps, os := pc.cache.Size()
	ch <- prometheus.MustNewConstMetric(pc.policies, prometheus.GaugeValue, float64(ps))
	ch <- prometheus.MustNewConstMetric(pc.overr, prometheus.GaugeValue, float64(os))
	loaded := 0.0
	if t := pc.cache.LoadedAt(); !t.IsZero() {
		loaded = float64(t.UnixNano()) / 1e9
	}
	ch <- prometheus.MustNewConstMetric(pc.loaded, prometheus.GaugeValue, loaded)
	d := st.Denials
	for _, o := range []struct {
		name string
		n    uint64
	}{{"applied", d.Applied}, {"refused", d.Refused}, {"unknown", d.Unknown},
		{"other_schema", d.OtherSchema}, {"invalid", d.Invalid}, {"dropped", d.Dropped}} {
		ch <- prometheus.MustNewConstMetric(pc.denials, prometheus.CounterValue, float64(o.n), o.name)
	}
}
