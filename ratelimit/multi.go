package ratelimit

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Check is one limit of a multi-limit decision.
type Check struct {
	// Limiter is the limit to check. Required.
	Limiter *Limiter
	// Key is the key to check it for.
	Key string
	// Cost is the units the check asks for. Defaults to 1.
	Cost int64
	// Rate, when not zero, is the rate the check counts against instead
	// of the limiter's own (as AtRate gives it to a single check).
	Rate Rate
}

// MultiMode says what a multi-limit decision consumes when a limit denies.
type MultiMode int

const (
	// AllOrNothing consumes nothing unless every limit allows: a request
	// denied by its per-IP limit does not eat into its per-email limit.
	// The default.
	AllOrNothing MultiMode = iota
	// ConsumeAll counts the request against every limit that allows it,
	// even when another denies (a global ceiling that must see every
	// attempt, however it ends).
	ConsumeAll
)

// MultiDecision is the outcome of a multi-limit decision.
type MultiDecision struct {
	// Allowed reports whether every limit allowed the request.
	Allowed bool
	// Decisions holds each limit's own decision, in the order of the
	// checks. Under AllOrNothing, when the request was denied, nothing was
	// consumed even where Decisions[i].Allowed is true: every Granted is 0,
	// while Used and Remaining are what the check saw inside the
	// transaction that was then rolled back (as if the units had been
	// taken). Peek reports the key's state afterwards.
	Decisions []Decision
	// DeniedBy is the index of the first check that denied, or -1.
	DeniedBy int
}

// RetryAfter is the longest RetryAfter of the denying checks: when every
// one of them would admit a retry. Zero when allowed.
func (m MultiDecision) RetryAfter() time.Duration {
	var r time.Duration
	for _, d := range m.Decisions {
		if !d.Allowed {
			r = max(r, d.RetryAfter)
		}
	}
	return r
}

// AllowAll decides several limits at once (for example a login's per
// email+IP, per IP and per email limits, or a per-IP limit and a global
// ceiling) in one transaction. Algorithms may be mixed;
// the limiters must share one database. The rows are locked in one fixed
// order (by table, then stored key), so concurrent decisions over
// overlapping keys never deadlock.
//
// When every limiter uses one algorithm, the decision is one check
// statement (migration 000014), which under AllOrNothing applies the checks
// only when all allow; through the limiters' shared coalescer it rides the
// statement of other callers' checks, so a login costs no round trip of
// its own. A decision that spans algorithms runs in a transaction of its
// own, one statement per algorithm, rolled back under AllOrNothing when a
// limit denies: two round trips more. Either way a denied request consumes
// nothing, every check is decided (each Decision says what its limit saw),
// and limiters in shadow mode never stop the others from consuming. Every
// check counts against its limiter's own rate, also a policy-backed one's
// (the rate its cache holds). When the database fails, each check is
// answered by its own limiter's failure policy. AllowAllTx does the same
// inside the caller's transaction.
func AllowAll(ctx context.Context, mode MultiMode, checks ...Check) (MultiDecision, error) {
	return allowAll(ctx, nil, mode, checks)
}

// AllowAllTx is AllowAll inside the caller's transaction: rolling the
// transaction back refunds every unit it consumed, and the limiters'
// databases are not used for the checks (they need not be the same). The
// checks run under a savepoint, released when they succeed and rolled back
// when they fail or, under AllOrNothing, when a limit denies, so the
// caller's transaction stays usable either way; that costs two more round
// trips than a statement alone. As with AllowTx, there is no failure
// policy, breaker, deny cache or DatabaseOptions.Timeout: errors are returned, and
// the rows stay locked until the transaction ends. In the partitioned
// layout, a missing partition is created outside the transaction (with
// CreatePartitions) and the checks are made again.
func AllowAllTx(ctx context.Context, tx pgx.Tx, mode MultiMode, checks ...Check) (MultiDecision, error) {
	if tx == nil {
		return MultiDecision{}, WithOutcome(ErrNilDB, OutcomeNotConsumed)
	}
	return allowAll(ctx, tx, mode, checks)
}

// allowAll validates checks and decides them through the stages of decide
// (pipeline.go): on the limiters' database with the failure policies when
// tx is nil, else under a savepoint of tx; and reports each check to its
// Observer.
func allowAll(ctx context.Context, tx pgx.Tx, mode MultiMode, checks []Check) (MultiDecision, error) {
	start := time.Now()
	req, err := newMultiRequest(tx, mode, checks)
	if err != nil {
		err = WithOutcome(err, OutcomeNotConsumed)
		observeRefused(checks, err, time.Since(start))
		return MultiDecision{}, err
	}
	decs, err := decide(ctx, req)
	err = WithOutcome(err, OutcomeNotConsumed) // refused before sending; decide marks what it sent
	decs = req.observe(decs, err, time.Since(start))
	if err != nil {
		return MultiDecision{}, err
	}
	out := MultiDecision{Allowed: true, Decisions: decs, DeniedBy: -1}
	for i, d := range decs {
		if !d.Allowed {
			out.Allowed = false
			if out.DeniedBy < 0 {
				out.DeniedBy = i
			}
		}
	}
	return out, nil
}

// newMultiRequest validates an AllowAll decision's checks (a Cost of 0 is
// 1) and makes its request, a spread limit's check decided by one of its
// rows.
func newMultiRequest(tx pgx.Tx, mode MultiMode, checks []Check) (*request, error) {
	if len(checks) == 0 {
		return nil, ErrEmptyMulti
	}
	if mode != AllOrNothing && mode != ConsumeAll {
		return nil, invalid(ErrInvalidMultiMode, "%d; use AllOrNothing or ConsumeAll", mode)
	}
	req := &request{checks: make([]*pendingCheck, len(checks)), whole: make([]*Limiter, len(checks)), multi: true,
		mode: mode, tx: tx}
	seen := map[string]int{}
	var db DB
	for i, c := range checks {
		if c.Limiter == nil {
			return nil, invalid(ErrNilLimiter, "check %d", i)
		}
		if c.Rate != (Rate{}) {
			lr, err := c.Limiter.WithRate(c.Rate)
			if err != nil {
				return nil, fmt.Errorf("check %d: %w", i, err)
			}
			c.Limiter = lr
		}
		whole := c.Limiter
		if c.Cost == 0 {
			c.Cost = 1
		}
		if err := c.Limiter.cfg.checkCost(c.Cost); err != nil {
			return nil, fmt.Errorf("check %d: %w", i, err)
		}
		if err := c.Limiter.cfg.checkKey(c.Key); err != nil {
			return nil, fmt.Errorf("check %d: %w", i, err)
		}
		if c.Limiter.shards != nil {
			// A spread limit is decided by one of its rows.
			c.Limiter = c.Limiter.pickShard(c.Cost)
		}
		if err := c.Limiter.cfg.checkCost(c.Cost); err != nil {
			return nil, fmt.Errorf("check %d: %w", i, err)
		}
		if i == 0 {
			db = c.Limiter.st.db
		} else if c.Limiter.st.db != db && tx == nil {
			return nil, invalid(ErrMixedDatabases, "check %d (%q) uses another database than check 0", i, c.Limiter.cfg.Name)
		}
		skey := c.Limiter.key(c.Key)
		id := string(c.Limiter.cfg.Algorithm) + "\x00" + string(skey)
		if j, dup := seen[id]; dup {
			return nil, invalid(ErrDuplicateCheck, "checks %d and %d (%q, same key); merge them into one check with the summed cost", j, i, c.Limiter.cfg.Name)
		}
		seen[id] = i
		req.checks[i] = &pendingCheck{l: c.Limiter, key: c.Key, skey: skey, ask: ask{n: c.Cost}}
		req.whole[i] = whole
	}
	return req, nil
}

// observeRefused reports a decision refused before any check was made (a
// bad argument) to the Observer of every limiter it names.
func observeRefused(checks []Check, err error, took time.Duration) {
	for _, c := range checks {
		if c.Limiter != nil && c.Limiter.st.opts.Observer != nil {
			c.Limiter.st.opts.Observer.ObserveDecision(c.Limiter.name, Decision{}, took, err)
		}
	}
}
