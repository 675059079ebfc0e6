package lease

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/pgrl/pgrl/ratelimit"
)

// Check is one limit of a leased multi-limit decision (AllowAll).
type Check struct {
	// Limiter is the lease limiter to check. Required.
	Limiter *Limiter
	// Key is the key to check it for.
	Key string
	// Cost is the units the check asks for. Defaults to 1.
	Cost int64
}

// ids numbers lease limiters, the order in which AllowAll holds the
// entries of several: two groups that share keys never wait on each other
// in a circle.
var ids atomic.Uint64

// member is one check of a group, with its entry held.
type member struct {
	x   *Limiter
	e   *entry
	a   ask
	st  state
	d   ratelimit.Decision // the refill's answer, when one was sent
	pg  bool               // d is a slice PostgreSQL granted
	fix bool               // d is the failure policy's answer (no slice)
}

// AllowAll decides several limits of one request, as ratelimit.AllowAll
// does, from the limiters' slices.
//
// Under ratelimit.AllOrNothing the request is admitted only when every
// limit admits it, and a denied request takes no unit from any slice.
// When every key's slice holds what its check asks, the request is
// decided in memory with no statement. Otherwise the slices that fall
// short take their next ones, each as Allow would (one statement each,
// sent at once and coalesced with other checks), and the request is
// decided from the slices; units a denied request's slices took stay in
// them for later checks (a shortfall, never an excess: they were counted
// before use). A group in which a key is checked for the first time (or
// for the first time after Options.Idle), or whose limiter's breaker is
// open, is sent as the caller's own checks through ratelimit.AllowAll
// instead: all or nothing in one statement, as without a lease, and the
// failure policies answer it as they would. Under Penalty a slice that
// still falls short pays for the attempt, as with Allow.
//
// Under ratelimit.ConsumeAll every check is decided on its own, as Allow
// decides it.
//
// The limiters must send their statements to one database, as
// ratelimit.AllowAll requires (ratelimit.ErrMixedDatabases otherwise), and
// the checks' keys must differ within a limiter (ratelimit.ErrDuplicateCheck
// otherwise; merge them into one check with the summed cost). Decisions
// answered from a slice have Store ratelimit.StoreLease.
func AllowAll(ctx context.Context, mode ratelimit.MultiMode, checks ...Check) (ratelimit.MultiDecision, error) {
	md, err := allowAll(ctx, mode, checks)
	return md, ratelimit.WithOutcome(err, ratelimit.OutcomeNotConsumed)
}

func allowAll(ctx context.Context, mode ratelimit.MultiMode, checks []Check) (ratelimit.MultiDecision, error) {
	ms, order, err := members(mode, checks)
	if err != nil {
		return ratelimit.MultiDecision{}, err
	}
	if mode == ratelimit.ConsumeAll {
		decs := make([]ratelimit.Decision, len(ms))
		for i := range ms {
			m := &ms[i]
			if decs[i], err = m.x.allow(ctx, checks[i].Key, []ratelimit.Option{ratelimit.Cost(m.a.n)}); err != nil {
				return ratelimit.MultiDecision{}, fmt.Errorf("check %d (%q): %w", i, m.x.name, err)
			}
		}
		return multi(decs), nil
	}
	for {
		held, err := hold(ctx, ms, order, checks)
		if err != nil {
			return ratelimit.MultiDecision{}, err
		}
		if !held {
			continue // an entry was removed meanwhile: look the keys up again
		}
		md, err := decideGroup(ctx, ms)
		for _, i := range order {
			ms[i].e.release()
		}
		return md, err
	}
}

// members validates a group's checks, and returns them with the order in
// which their entries are held: by limiter, then key, one order for every
// group (a limiter and key twice would be adjacent in it, and is refused).
func members(mode ratelimit.MultiMode, checks []Check) ([]member, []int, error) {
	if len(checks) == 0 {
		return nil, nil, ratelimit.ErrEmptyMulti
	}
	if mode != ratelimit.AllOrNothing && mode != ratelimit.ConsumeAll {
		return nil, nil, fmt.Errorf("%w: %d; use ratelimit.AllOrNothing or ratelimit.ConsumeAll", ratelimit.ErrInvalidMultiMode, mode)
	}
	ms := make([]member, len(checks))
	order := make([]int, len(checks))
	for i, c := range checks {
		if c.Limiter == nil {
			return nil, nil, fmt.Errorf("%w: check %d; give each check the *lease.Limiter of its limit", ErrNilLimiter, i)
		}
		if c.Limiter.closed.Load() {
			return nil, nil, fmt.Errorf("check %d (%q): %w", i, c.Limiter.name, ErrClosed)
		}
		if c.Cost < 0 {
			return nil, nil, fmt.Errorf("%w: %d in check %d (%q); a check asks for at least 1 unit (0 means 1)", ratelimit.ErrInvalidCost, c.Cost, i, c.Limiter.name)
		}
		ms[i] = member{x: c.Limiter, a: ask{n: max(c.Cost, 1)}}
		order[i] = i
	}
	slices.SortFunc(order, func(i, j int) int {
		return cmp.Or(cmp.Compare(ms[i].x.id, ms[j].x.id), cmp.Compare(checks[i].Key, checks[j].Key), cmp.Compare(i, j))
	})
	for k := 1; k < len(order); k++ {
		i, j := order[k-1], order[k]
		if ms[i].x == ms[j].x && checks[i].Key == checks[j].Key {
			return nil, nil, fmt.Errorf("%w: checks %d and %d (%q, same key); merge them into one check with the summed cost", ratelimit.ErrDuplicateCheck, i, j, ms[i].x.name)
		}
	}
	return ms, order, nil
}

// hold takes the entries of ms in order. It reports false, holding
// none, when one of them was removed before it was held.
func hold(ctx context.Context, ms []member, order []int, checks []Check) (bool, error) {
	for k, i := range order {
		m := &ms[i]
		if m.x.closed.Load() {
			releaseFirst(ms, order, k)
			return false, fmt.Errorf("check %d (%q): %w", i, m.x.name, ErrClosed)
		}
		m.e = m.x.entry(checks[i].Key)
		if err := m.e.acquire(ctx); err != nil {
			releaseFirst(ms, order, k)
			return false, err
		}
		if m.e.dead {
			releaseFirst(ms, order, k+1)
			return false, nil
		}
	}
	return true, nil
}

// releaseFirst releases the entries of the first n members in order.
func releaseFirst(ms []member, order []int, n int) {
	for _, i := range order[:n] {
		ms[i].e.release()
	}
}

// decideGroup decides an all-or-nothing group whose entries are held.
func decideGroup(ctx context.Context, ms []member) (ratelimit.MultiDecision, error) {
	local, own := true, false
	for i := range ms {
		m := &ms[i]
		st, err := m.x.prepare(ctx, m.e, m.a)
		if err != nil {
			return ratelimit.MultiDecision{}, fmt.Errorf("check %d (%q): %w", i, m.x.name, err)
		}
		if i > 0 && !st.src.l.SameDatabase(ms[0].st.src.l) {
			return ratelimit.MultiDecision{}, fmt.Errorf("%w: check %d (%q) leases a limiter of another database than check 0 (%q); lease limiters made on one pool, as ratelimit.AllowAll checks them together", ratelimit.ErrMixedDatabases, i, m.x.name, ms[0].x.name)
		}
		m.st = st
		if m.e.left < m.a.n {
			local = false
			own = own || st.cold && !m.x.opts.Eager || st.src.l.BreakerOpen()
		}
	}
	decs := make([]ratelimit.Decision, len(ms))
	if local {
		for i := range ms {
			m := &ms[i]
			decs[i] = m.x.takeLocal(m.e, m.st.now, m.a.n)
		}
		return multi(decs), nil
	}
	if own {
		return sendOwn(ctx, ms)
	}
	if err := refillShort(ctx, ms); err != nil {
		return ratelimit.MultiDecision{}, err
	}
	allowed := true
	for i := range ms {
		m := &ms[i]
		switch {
		case m.fix:
			allowed = allowed && m.d.Allowed // a shadow denial is allowed
		case m.e.left < m.a.n && !m.st.src.cfg.Shadow:
			// A limit in shadow mode never vetoes: it reports.
			allowed = false
		}
	}
	for i := range ms {
		m := &ms[i]
		switch {
		case m.fix:
			decs[i] = passThrough(m.d, m.a)
			if !allowed {
				decs[i].Granted = 0
			}
		case m.pg:
			decs[i] = m.x.settle(m.e, m.a, m.d, allowed)
		case allowed:
			decs[i] = m.x.takeLocal(m.e, m.st.now, m.a.n)
		default:
			// Allowed, but another check denied: nothing is taken. Used
			// and Remaining are what the check saw with its units taken,
			// as ratelimit.AllowAll reports them.
			m.x.local.Add(1)
			decs[i] = m.x.localDecision(m.e, m.st.now, 0)
			decs[i].Used += m.a.n
			decs[i].Remaining -= m.a.n
		}
	}
	return multi(decs), nil
}

// sendOwn sends the group's own checks through ratelimit.AllowAll: a key
// that is cold, or a breaker that is open, gets no slice.
func sendOwn(ctx context.Context, ms []member) (ratelimit.MultiDecision, error) {
	own := make([]ratelimit.Check, len(ms))
	for i := range ms {
		m := &ms[i]
		own[i] = ratelimit.Check{Limiter: m.st.src.l, Key: m.e.key, Cost: m.a.n}
	}
	md, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, own...)
	for i := range ms {
		m := &ms[i]
		var d ratelimit.Decision
		if err == nil {
			d = md.Decisions[i]
		}
		m.x.count(d, err)
	}
	return md, err
}

// refillShort takes the next slice of every member whose entry holds too
// few units, all at once, so that their statements are coalesced.
func refillShort(ctx context.Context, ms []member) error {
	var short []*member
	for i := range ms {
		if m := &ms[i]; m.e.left < m.a.n {
			short = append(short, m)
		}
	}
	errs := make([]error, len(short))
	refill := func(k int) {
		m := short[k]
		m.d, errs[k] = m.x.refill(ctx, m.e, m.a, m.st)
		m.pg = errs[k] == nil && m.d.Store == ratelimit.StorePostgres
		m.fix = errs[k] == nil && !m.pg
	}
	if len(short) == 1 {
		refill(0)
	} else {
		var wg sync.WaitGroup
		for k := range short {
			wg.Go(func() { refill(k) })
		}
		wg.Wait()
	}
	for k, err := range errs {
		if err != nil {
			return fmt.Errorf("%q: %w", short[k].x.name, err)
		}
	}
	return nil
}

// multi is the MultiDecision of decs.
func multi(decs []ratelimit.Decision) ratelimit.MultiDecision {
	md := ratelimit.MultiDecision{Allowed: true, Decisions: decs, DeniedBy: -1}
	for i, d := range decs {
		if !d.Allowed {
			md.Allowed = false
			if md.DeniedBy < 0 {
				md.DeniedBy = i
			}
		}
	}
	return md
}
