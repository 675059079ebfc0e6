package metrics

import (
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// Metric names of lease limiters (package lease).
const (
	LeaseSlicesTotal      = "pgrl_lease_slices_total"
	LeaseUnitsLeasedTotal = "pgrl_lease_units_leased_total"
	LeaseUnitsTotal       = "pgrl_lease_units_total"
	LeaseDecisionsTotal   = "pgrl_lease_decisions_total"
)

// Values of the outcome label of pgrl_lease_units_total: what became of
// the units leased.
const (
	LeaseUnitsUsed     = "used"
	LeaseUnitsReturned = "returned"
	LeaseUnitsDropped  = "dropped"
)

// StoreOther is the store label of pgrl_lease_decisions_total for the
// checks a lease limiter's *ratelimit.Limiter answered without PostgreSQL
// (its deny cache or its failure policy).
const StoreOther = "other"

// Errors of LeaseCollector.Add and NewLeaseCollector. Test with errors.Is.
var (
	// ErrNilLease: a nil *lease.Limiter.
	ErrNilLease = errors.New("pgrl metrics: nil lease limiter; pass the *lease.Limiter returned by lease.New")
	// ErrDuplicateLease: a lease limiter of that name is already
	// collected; names are the limiter label, so they must differ.
	ErrDuplicateLease = errors.New("pgrl metrics: a lease limiter of that name is already collected")
)

// LeaseCollector exports the counters of lease limiters (lease.Stats) as
// Prometheus metrics, read at each scrape, with the leased limiter's
// Config().Name as the "limiter" label:
//
//   - pgrl_lease_slices_total{limiter}: statements that took a slice of at
//     least one unit (Stats.Slices);
//   - pgrl_lease_units_leased_total{limiter}: the units those slices took
//     (Stats.Leased);
//   - pgrl_lease_units_total{limiter, outcome}: what became of them: used
//     by checks (Stats.UsedLocally), returned to the database
//     (Stats.Returned) or dropped (Stats.Dropped). Leased less the sum of
//     the three is what the process holds now;
//   - pgrl_lease_decisions_total{limiter, store}: checks answered, by what
//     answered them: lease (a slice, no statement; Stats.LocalDecisions),
//     postgres (Stats.DatabaseDecisions) and other (the limiter's deny
//     cache or failure policy; Stats.OtherDecisions).
//
// One LeaseCollector serves every lease limiter of a registry: create it
// once and Add each limiter. A second LeaseCollector on the same registry
// fails to register.
type LeaseCollector struct {
	mu     sync.Mutex
	leases map[string]*lease.Limiter

	slices    *prometheus.Desc
	leased    *prometheus.Desc
	units     *prometheus.Desc
	decisions *prometheus.Desc
}

// NewLeaseCollector creates the collector of the lease limiters ls (more
// can be added with Add) and registers it with reg
// (prometheus.DefaultRegisterer when nil). It fails, registering nothing,
// when a limiter is nil (ErrNilLease) or two have one name
// (ErrDuplicateLease).
func NewLeaseCollector(reg prometheus.Registerer, ls ...*lease.Limiter) (*LeaseCollector, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	lc := &LeaseCollector{
		leases: make(map[string]*lease.Limiter),
		slices: prometheus.NewDesc(LeaseSlicesTotal,
			"Statements of a lease limiter that took a slice of at least one unit of a key's quota.",
			[]string{"limiter"}, nil),
		leased: prometheus.NewDesc(LeaseUnitsLeasedTotal,
			"Units of quota taken by a lease limiter's slices.",
			[]string{"limiter"}, nil),
		units: prometheus.NewDesc(LeaseUnitsTotal,
			"Leased units by outcome: used (given to checks), returned (given back to the database), dropped (neither: window ended, key reset, sliding window).",
			[]string{"limiter", "outcome"}, nil),
		decisions: prometheus.NewDesc(LeaseDecisionsTotal,
			"Checks a lease limiter answered, by what answered: lease (a slice, no statement), postgres, other (deny cache or failure policy).",
			[]string{"limiter", "store"}, nil),
	}
	for _, x := range ls {
		if err := lc.Add(x); err != nil {
			return nil, err
		}
	}
	if err := reg.Register(lc); err != nil {
		return nil, err
	}
	return lc, nil
}

// Add collects x under its Config().Name. It fails when x is nil
// (ErrNilLease) or a limiter of that name is already collected
// (ErrDuplicateLease), x itself included.
func (lc *LeaseCollector) Add(x *lease.Limiter) error {
	if x == nil {
		return ErrNilLease
	}
	name := x.Config().Name
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if _, ok := lc.leases[name]; ok {
		return fmt.Errorf("%w: %q; give each leased limiter its own name, or Remove the old one first", ErrDuplicateLease, name)
	}
	lc.leases[name] = x
	return nil
}

// Remove stops collecting x (after its Close, say, to Add its successor
// of the same name). It reports whether x was collected.
func (lc *LeaseCollector) Remove(x *lease.Limiter) bool {
	if x == nil {
		return false
	}
	name := x.Config().Name
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.leases[name] != x {
		return false
	}
	delete(lc.leases, name)
	return true
}

// Describe implements prometheus.Collector.
func (lc *LeaseCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{lc.slices, lc.leased, lc.units, lc.decisions} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (lc *LeaseCollector) Collect(ch chan<- prometheus.Metric) {
	lc.mu.Lock()
	names := make([]string, 0, len(lc.leases))
	for name := range lc.leases {
		names = append(names, name)
	}
	sort.Strings(names)
	ls := make([]*lease.Limiter, len(names))
	for i, name := range names {
		ls[i] = lc.leases[name]
	}
	lc.mu.Unlock()
	for i, x := range ls {
		name, st := names[i], x.Stats()
		counter := func(d *prometheus.Desc, n int64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(n), append([]string{name}, labels...)...)
		}
		counter(lc.slices, st.Slices)
		counter(lc.leased, st.Leased)
		counter(lc.units, st.UsedLocally, LeaseUnitsUsed)
		counter(lc.units, st.Returned, LeaseUnitsReturned)
		counter(lc.units, st.Dropped, LeaseUnitsDropped)
		counter(lc.decisions, st.LocalDecisions, string(ratelimit.StoreLease))
		counter(lc.decisions, st.DatabaseDecisions, string(ratelimit.StorePostgres))
		counter(lc.decisions, st.OtherDecisions, StoreOther)
	}
}
