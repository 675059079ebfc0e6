package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgrl/pgrl/internal/pgerr"
)

// StatementTimeoutParam is the run-time parameter that bounds a statement
// on the server. Set it on the pool's connections, a little below
// DatabaseOptions.Timeout, so that a check stuck behind a lock or a slow server is
// abandoned by PostgreSQL before the client gives up (a client-side
// cancellation closes the connection; a server-side timeout does not):
//
//	cfg.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = "200ms"
const StatementTimeoutParam = "statement_timeout"

// Observer receives what a limiter does, for metrics (package
// github.com/pgrl/pgrl/metrics implements it for Prometheus). Its methods are
// called on the checking goroutine and must be fast and safe for concurrent use.
type Observer interface {
	// ObserveDecision is called after every check that counts (Allow,
	// AllowTx, and each limit of AllowAll) with the
	// decision, how long the check took, and its error (nil when a
	// decision was made, by whatever store). Peek counts nothing and is
	// not observed.
	ObserveDecision(limiter string, d Decision, took time.Duration, err error)
	// ObserveBreaker is called when the breaker opens (open true) after
	// repeated database failures, and when it closes again.
	ObserveBreaker(limiter string, open bool)
}

// breaker stops sending checks to a database that keeps failing. After
// threshold consecutive failures it opens for cooldown; then one check at a
// time probes the database, and the first success closes it. It logs each
// outage once when it opens and once on recovery.
type breaker struct {
	threshold int64
	cooldown  time.Duration
	// probeLimit is how long a probe may run before another check may
	// probe: a cool-down past the check deadline (DatabaseOptions.Timeout), since a
	// probe still waiting for a stalled database has not been abandoned.
	probeLimit time.Duration
	logger     *slog.Logger
	notify     func(bool) // tells the Observer the breaker opened (true) or closed

	failures  atomic.Int64
	open      atomic.Bool
	openUntil atomic.Int64 // unix nanoseconds
	probeAt   atomic.Int64 // unix nanoseconds the running probe began; 0 for none
	mu        sync.Mutex
	since     time.Time
}

// newBreaker returns the breaker of a Database with options o (defaults
// applied).
func newBreaker(o DatabaseOptions, notify func(open bool)) *breaker {
	return &breaker{threshold: int64(o.BreakerThreshold), cooldown: o.BreakerCooldown,
		probeLimit: o.Timeout + o.BreakerCooldown, logger: o.Logger, notify: notify}
}

// allow reports whether a check may go to the database now. While the
// breaker is open, the one check let through is the probe: probe is its
// token (nonzero), which it hands back to success or failure, so that only
// the probe's own outcome ends its turn. A check that was sent before the
// breaker opened, or a probe forgotten after a deadline and a cool-down,
// fails late without starting another probe early.
func (b *breaker) allow(now time.Time) (probe int64, ok bool) {
	if !b.open.Load() {
		return 0, true
	}
	if now.UnixNano() < b.openUntil.Load() {
		return 0, false
	}
	// Cool-down over: let one probe through at a time. A probe whose
	// caller gave up (its context ended, so it recorded neither success
	// nor failure) is forgotten once it has run for a deadline and a
	// cool-down, so the breaker cannot stay open for good; a probe that is
	// only slow is not, or a stall would pile up a probe every cool-down.
	p := b.probeAt.Load()
	if p != 0 && now.UnixNano()-p < int64(b.probeLimit) {
		return 0, false
	}
	t := max(now.UnixNano(), p+1)
	if !b.probeAt.CompareAndSwap(p, t) {
		return 0, false
	}
	return t, true
}

// success records a check the database answered; probe is the token
// allow gave it. While the breaker is open, only a probe closes it: a check
// sent before the outage that succeeds late says nothing about the database
// now, and closing on it would log a recovery and a second outage for one
// outage.
func (b *breaker) success(probe int64) {
	b.failures.Store(0)
	if probe != 0 && b.open.Load() {
		b.mu.Lock()
		if b.open.Load() {
			b.open.Store(false)
			b.notify(false)
			b.logger.Info("pgrl: database answering again; checks go to PostgreSQL",
				"outage", time.Since(b.since).Round(time.Millisecond).String())
		}
		b.mu.Unlock()
		b.probeAt.Store(0) // closed: no probe is running any more
	}
}

// failure records a check the database failed, with its error. A lock
// wait that ran out (lock_timeout, SQLSTATE 55P03) is one key's contention,
// not an outage: it is answered by the policy but does not count towards
// opening the breaker, so that one locked row does not send every other
// key to the fallback.
func (b *breaker) failure(now time.Time, err error, policy FailurePolicy, probe int64) {
	if pgerr.IsLockTimeout(err) {
		return
	}
	n := b.failures.Add(1)
	if b.open.Load() {
		// Only the running probe's failure starts the next cool-down; a
		// late failure of a check sent earlier leaves the probe's turn be.
		if probe != 0 && b.probeAt.CompareAndSwap(probe, 0) {
			b.openUntil.Store(now.Add(b.cooldown).UnixNano())
		}
		return
	}
	if n < b.threshold {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.open.Load() {
		return
	}
	b.since = now
	b.openUntil.Store(now.Add(b.cooldown).UnixNano())
	b.open.Store(true)
	b.notify(true)
	b.logger.Warn("pgrl: database unavailable; answering checks by failure policy until it recovers",
		"policy", policy.String(), "error", err.Error())
}

// errBreakerOpen is the reason given while the breaker skips the database.
var errBreakerOpen = errors.New("breaker open after repeated database failures")

// callerDone reports whether the caller's own context has ended, or its
// deadline has passed (its timer may not have fired yet when the driver,
// racing it, already gave up): the caller then gets an error, not a
// failure-policy answer.
func callerDone(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// callerErr is the error of a context that callerDone reported done.
func callerErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

// fallback answers a check the database could not, by the failure policy.
func (l *Limiter) fallback(ctx context.Context, key string, a ask, cause error) (Decision, error) {
	reason := fmt.Sprintf("database unavailable (%v): %s", cause, l.cfg.OnFailure)
	switch l.cfg.OnFailure {
	case FailOpen:
		return Decision{Allowed: true, Limit: l.cfg.capacity(), Remaining: 0, Now: time.Now(), Store: StorePolicy, Reason: reason}, nil
	case FailClosed:
		now := time.Now()
		return l.shadow(key, Decision{Allowed: false, Limit: l.cfg.capacity(), Now: now, RetryAfter: l.st.opts.BreakerCooldown,
			ResetAt: now.Add(l.st.opts.BreakerCooldown), Store: StorePolicy, Reason: reason}), nil
	case FailError:
		return Decision{}, cause
	default:
		d, err := l.memory.fallbackAsk(key, a.own())
		if err != nil {
			return Decision{}, err
		}
		d.Reason = reason
		return l.shadow(key, d), nil
	}
}

// shadow applies shadow mode: a denial is reported, logged and allowed.
func (l *Limiter) shadow(key string, d Decision) Decision {
	return shadowed(&l.cfg, l.st.opts.Logger, &l.shadowLogged, d)
}

// shadowed applies cfg's shadow mode to d: a denial is reported, logged (at
// most once a second, logged holding the last time) and allowed. Granted
// stays what the limit granted, nothing (see ask.settle).
func shadowed(cfg *Config, logger *slog.Logger, logged *atomic.Int64, d Decision) Decision {
	if !cfg.Shadow || d.Allowed {
		return d
	}
	d.Allowed = true
	d.ShadowDenied = true
	d.RetryAfter = 0
	d.Granted = 0
	now := time.Now().UnixNano()
	last := logged.Load()
	if now-last >= int64(time.Second) && logged.CompareAndSwap(last, now) {
		logger.Info("pgrl: shadow limit would have denied a check (logged at most once a second)",
			"limiter", cfg.Name, "store", string(d.Store), "limit", d.Limit)
	}
	return d
}
