package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/lease"
	"github.com/pgrl/pgrl/ratelimit"
)

// With --lease-size N, pgrl's limiters in the key-space cases and in the
// application mix are wrapped with lease.New (Size N) where package lease
// supports them; a login's three limits are checked together with
// lease.AllowAll. The beacon (in memory), --compare-coalescing's and
// --variant's paths, and the populate step stay unleased.

// LeaseStats are lease.Stats summed over a case's leased limiters, over the
// whole case (warm-up and every slice, measured or not), read after Close
// returned their unused units.
type LeaseStats struct {
	// Limits are the names of the leased limits.
	Limits            []string `json:"limits"`
	Slices            int64    `json:"slices"`
	UnitsLeased       int64    `json:"units_leased"`
	UsedLocally       int64    `json:"used_locally"`
	Returned          int64    `json:"returned"`
	Dropped           int64    `json:"dropped"`
	LocalDecisions    int64    `json:"local_decisions"`
	DatabaseDecisions int64    `json:"database_decisions"`
	OtherDecisions    int64    `json:"other_decisions"`
	// Admitted is the checks the leased limiters admitted; every one was
	// verified when made (allowed, Used within the limit), and
	// NeverOverLimit says the end-of-run check held: for each leased
	// limit, all it admitted in the case, so a fortiori per key and
	// window, is within its limit.
	Admitted       int64 `json:"admitted"`
	NeverOverLimit bool  `json:"never_over_limit"`
}

// DatabaseDecisionsPerCheck is the leased checks PostgreSQL answered per
// leased check: one statement each, the rest were answered in memory.
func (s *LeaseStats) DatabaseDecisionsPerCheck() float64 {
	if n := s.LocalDecisions + s.DatabaseDecisions + s.OtherDecisions; n > 0 {
		return loadtest.Round(float64(s.DatabaseDecisions)/float64(n), 4)
	}
	return 0
}

// leasedLimit is one leased limiter and the units it admitted.
type leasedLimit struct {
	*lease.Limiter
	admitted atomic.Int64
}

// admit verifies a leased decision of key and counts it: the benchmark
// measures admitted checks, and no decision may report more used than the
// limit.
func (l *leasedLimit) admit(key string, d ratelimit.Decision) error {
	if !d.Allowed || (d.Store != ratelimit.StoreLease && d.Store != ratelimit.StorePostgres) {
		return fmt.Errorf("leased check of %s %q: allowed=%v store=%v: the benchmark measures admitted checks answered by a slice or by PostgreSQL", l.Config().Name, key, d.Allowed, d.Store)
	}
	if d.Used > d.Limit {
		return fmt.Errorf("leased check of %s %q: used %d over the limit %d", l.Config().Name, key, d.Used, d.Limit)
	}
	l.admitted.Add(d.Granted)
	return nil
}

// leaseSet is a case's leased limiters.
type leaseSet struct {
	limits []*leasedLimit
}

// wrap leases lim's quota in slices of o.leaseSize (at most lim's limit),
// returning unused units on db.
func (s *leaseSet) wrap(lim *ratelimit.Limiter, o options, db ratelimit.DB) (*leasedLimit, error) {
	size := min(o.leaseSize, lim.Config().Limit)
	x, err := lease.New(lim, lease.Options{Size: size, Share: o.leaseShare, Idle: o.leaseIdle, DB: db})
	if err != nil {
		return nil, fmt.Errorf("lease %s: %w", lim.Config().Name, err)
	}
	l := &leasedLimit{Limiter: x}
	s.limits = append(s.limits, l)
	return l, nil
}

// close closes every leased limiter; it may be called again.
func (s *leaseSet) close(ctx context.Context) error {
	var errs []error
	for _, l := range s.limits {
		errs = append(errs, l.Close(ctx))
	}
	return errors.Join(errs...)
}

// finish closes the leased limiters, sums their stats and makes the
// end-of-run check; nil when nothing was leased.
func (s *leaseSet) finish(ctx context.Context) (*LeaseStats, error) {
	if len(s.limits) == 0 {
		return nil, nil
	}
	if err := s.close(ctx); err != nil {
		return nil, fmt.Errorf("close the leased limiters: %w", err)
	}
	st := &LeaseStats{NeverOverLimit: true}
	for _, l := range s.limits {
		x := l.Stats()
		cfg := l.Config()
		st.Limits = append(st.Limits, cfg.Name)
		st.Slices += x.Slices
		st.UnitsLeased += x.Leased
		st.UsedLocally += x.UsedLocally
		st.Returned += x.Returned
		st.Dropped += x.Dropped
		st.LocalDecisions += x.LocalDecisions
		st.DatabaseDecisions += x.DatabaseDecisions
		st.OtherDecisions += x.OtherDecisions
		n := l.admitted.Load()
		st.Admitted += n
		// The limits are so large that a run's whole admitted count fits
		// within one (a token bucket's burst): then no key admitted more
		// than its limit in any window. A run too long for that cannot be
		// vouched for this way.
		most := cfg.Limit
		if cfg.Algorithm == ratelimit.TokenBucket {
			most = cfg.Burst
		}
		if n > most {
			st.NeverOverLimit = false
			return st, fmt.Errorf("leased limit %s admitted %d checks in the case, more than its limit %d: the end-of-run check cannot show that no key went over its limit in a window; run shorter cases", cfg.Name, n, most)
		}
	}
	return st, nil
}

// leasedCheck is pgrlCheck on a leased limiter.
func leasedCheck(l *leasedLimit, keys []string) loadtest.Check {
	return func(ctx context.Context, k int) error {
		d, err := l.Allow(ctx, keys[k])
		if err != nil {
			return err
		}
		return l.admit(keys[k], d)
	}
}

// leasedMixLimits are the names of the mix's limits a leased run leases,
// and the others, with why they are not leased.
func leasedMixLimits() (leased, unleased []string) {
	var memory []string
	for _, l := range appLimits {
		if l.memory {
			memory = append(memory, l.name)
		} else {
			leased = append(leased, l.name)
		}
	}
	if len(memory) > 0 {
		unleased = append(unleased, strings.Join(memory, ", ")+" (in process memory)")
	}
	return leased, unleased
}
