package ratelimit

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Every check goes through decide, whether it is one check (Allow and
// AllowTx, with any options) or the checks of one AllowAll decision, in
// these stages, in this order:
//
//  1. validate: the ask and the key, before anything else (the callers:
//     Limiter.check, checkAll; the rules are in config.go);
//  2. deny cache: a denial this process already knows, or another process
//     shared, answers without a round trip (denied; denycache.go,
//     denyshare.go);
//  3. breaker: a database that keeps failing is skipped (resilience.go);
//  4. engine: the statement, within DatabaseOptions.Timeout whatever the caller's
//     context, coalesced with other callers' checks; a missing partition
//     is created and the statement sent again (engine; coalesce.go,
//     queue.go, multi.go, the algorithms' files);
//  5. failure policy: what the database could not answer (fail;
//     resilience.go); errors that are the caller's to fix are returned;
//  6. remember: a denial goes into the deny cache, and to other processes;
//  7. shadow: a denial is reported and allowed (resilience.go);
//  8. observe: DatabaseOptions.Observer sees each decision (observe).
//
// A check inside the caller's transaction skips stages 2, 3, 5 and 6: its
// errors are the caller's, and its units are refunded with the
// transaction.

// request is what one call decides: one check, or the checks of an
// AllowAll decision.
type request struct {
	// checks holds one pendingCheck per check, in the caller's order, its
	// limiter the row that decides (a spread limit's row picked).
	checks []*pendingCheck
	// whole holds the limiter each check was made on: the spread limit
	// itself where checks holds one of its rows.
	whole []*Limiter
	multi bool      // an AllowAll decision
	mode  MultiMode // an AllowAll decision's mode
	tx    pgx.Tx    // the caller's transaction, or nil
}

// decide runs req through the stages and returns one decision per check,
// in req's order.
func decide(ctx context.Context, req *request) ([]Decision, error) {
	first := req.whole[0]
	sent := first.localNow()
	if req.tx == nil && req.checks[0].ask.id == nil {
		// A check with a request id may have been decided before: it
		// is answered by the statement, which knows.
		if decs, ok := req.denied(sent); ok {
			return req.shadow(decs), nil
		}
	}
	var probe int64
	if req.tx == nil {
		var ok bool
		if probe, ok = first.st.breaker.allow(sent); !ok {
			decs, err := req.fail(ctx, errBreakerOpen)
			return decs, WithOutcome(err, OutcomeNotConsumed)
		}
	}
	decs, err := req.engine(ctx)
	if err != nil {
		// What the statement did, read before the error is replaced or
		// explained; every error below carries it.
		o := statementOutcome(err, req.tx != nil)
		if callerDone(ctx) {
			return nil, WithOutcome(fmt.Errorf("ratelimit: %w", callerErr(ctx)), o)
		}
		err = WithOutcome(first.explain(ctx, err), o)
		if req.tx != nil {
			return nil, err
		}
		if IsConfigError(err) {
			first.st.breaker.success(probe) // the database answered
			return nil, err
		}
		first.st.breaker.failure(time.Now(), err, first.cfg.OnFailure, probe)
		decs, err := req.fail(ctx, err)
		return decs, WithOutcome(err, o)
	}
	if req.tx == nil {
		first.st.breaker.success(probe)
		req.remember(decs, sent)
	}
	for i, r := range req.checks {
		decs[i] = req.whole[i].asWhole(r.l, decs[i])
	}
	if !req.multi && req.tx == nil && first.st.opts.Cleanup != nil {
		if p, ok := first.st.db.(*pooled); ok {
			first.st.opts.Cleanup.Maybe(ctx, p.pool)
		}
	}
	return req.shadow(decs), nil
}

// denied answers req from the deny cache when a check's denial is known:
// a single check, or any check of an AllOrNothing decision (whose other
// checks are then not made); a ConsumeAll decision counts every attempt.
func (req *request) denied(now time.Time) ([]Decision, bool) {
	if req.multi && req.mode != AllOrNothing {
		return nil, false
	}
	for i, r := range req.checks {
		if r.l.deny == nil || req.multi && r.l.cfg.Shadow {
			continue
		}
		d, ok := r.l.deny.get(r.key, r.ask.retryCost(), now)
		if !ok && !req.multi {
			d, ok = r.l.sharedDenied(r.key, r.ask.retryCost(), now)
		}
		if !ok {
			continue
		}
		decs := make([]Decision, len(req.checks))
		for j, other := range req.whole {
			decs[j] = Decision{Allowed: true, Limit: other.cfg.capacity(), Store: StoreDenyCache, Now: d.Now,
				Reason: "not checked: another limit of the decision denied"}
		}
		decs[i] = req.whole[i].asWhole(r.l, d)
		return decs, true
	}
	return nil, false
}

// engine asks PostgreSQL: a single check through its limiter's coalescer
// (Limiter.allowWithin), or the decision's checks (decideMultiWithin).
func (req *request) engine(ctx context.Context) ([]Decision, error) {
	if req.multi {
		return decideMultiWithin(ctx, req.tx, req.mode, req.checks)
	}
	r := req.checks[0]
	var d Decision
	var err error
	if req.tx != nil {
		d, err = r.l.takeInTx(ctx, req.tx, r.key, r.ask)
	} else {
		d, err = r.l.allowWithin(ctx, r.key, r.ask)
	}
	if err != nil {
		return nil, err
	}
	return []Decision{d}, nil
}

// fail answers every check of req by its limiter's failure policy, cause
// being what the database did.
func (req *request) fail(ctx context.Context, cause error) ([]Decision, error) {
	decs := make([]Decision, len(req.checks))
	for i, r := range req.checks {
		d, err := req.whole[i].fallback(ctx, r.key, r.ask, cause)
		if err != nil {
			return nil, err
		}
		decs[i] = d
	}
	return decs, nil
}

// remember puts each denial into its row's deny cache and, for a single
// check, shares it with other processes.
func (req *request) remember(decs []Decision, sent time.Time) {
	for i, r := range req.checks {
		if decs[i].Allowed || r.l.deny == nil {
			continue
		}
		r.l.deny.put(r.key, r.ask.retryCost(), decs[i], sent)
		if !req.multi {
			r.l.shareDenial(r.key, r.ask.retryCost(), decs[i], sent)
		}
	}
}

// shadow applies each check's shadow mode to its decision.
func (req *request) shadow(decs []Decision) []Decision {
	for i, r := range req.checks {
		decs[i] = req.whole[i].shadow(r.key, decs[i])
	}
	return decs
}

// observe reports each check's decision, settled (see ask.settle), to its
// limiter's Observer, and returns the settled decisions.
func (req *request) observe(decs []Decision, err error, took time.Duration) []Decision {
	refused := req.multi && req.mode == AllOrNothing && !allAllowed(decs)
	for i, r := range req.checks {
		var d Decision
		if i < len(decs) {
			d = r.ask.settle(decs[i])
			if refused {
				d.Granted = 0
			}
			decs[i] = d
		}
		if o := req.whole[i].st.opts.Observer; o != nil {
			o.ObserveDecision(req.whole[i].name, d, took, err)
		}
	}
	return decs
}

// allAllowed reports whether every decision allowed.
func allAllowed(decs []Decision) bool {
	for _, d := range decs {
		if !d.Allowed {
			return false
		}
	}
	return true
}
