package ratelimit

import (
	"context"
	"sync"
	"time"
)

// deadlines bounds a Database's checks by DatabaseOptions.Timeout without
// a runtime timer per check. context.WithTimeout arms a timer for every
// check, and arming one wakes the Go scheduler's network poller: about
// 6 µs of CPU per check, 5–7% of a lone check's latency (docs/PERFORMANCE.md).
// Instead a check registers its deadline here, and one goroutine, which
// runs only while checks are in flight (it ends after a second without
// any), ends those past their deadline at each tick: a check's deadline
// passes up to one tick late, a sixteenth of the Timeout. A Timeout under
// minTickedTimeout, whose tick would be shorter than a millisecond, keeps a
// timer per check.
type deadlines struct {
	tick time.Duration

	mu      sync.Mutex
	pending map[*boundCtx]struct{}
	running bool      // the ticking goroutine runs
	busy    time.Time // when a check was last pending
}

// minTickedTimeout is the shortest Timeout bounded by ticks.
const minTickedTimeout = 16 * time.Millisecond

// deadlinesIdle is how long the ticking goroutine outlives the last check.
const deadlinesIdle = time.Second

func newDeadlines(timeout time.Duration) *deadlines {
	return &deadlines{tick: timeout / 16, pending: map[*boundCtx]struct{}{}}
}

// within returns ctx bounded by timeout from now (or by ctx's own deadline,
// when it is sooner), and the function that releases it, as
// context.WithTimeout does.
func (d *deadlines) within(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return d.until(ctx, time.Now().Add(timeout))
}

// until returns ctx bounded by deadline (or by ctx's own, when it is
// sooner), and the function that releases it, as context.WithDeadline does.
func (d *deadlines) until(ctx context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	if dl, ok := ctx.Deadline(); ok && !dl.After(deadline) {
		// ctx ends first, by its own timer.
		return context.WithCancel(ctx)
	}
	if d == nil || d.tick < minTickedTimeout/16 || time.Until(deadline) < 8*d.tick {
		// A tick late would be too late: more than an eighth of the time
		// left (a caller's deadline sooner than the Timeout, passed on).
		return context.WithDeadline(ctx, deadline)
	}
	inner, cancel := context.WithCancelCause(ctx)
	c := &boundCtx{Context: inner, deadline: deadline, cancel: cancel}
	d.mu.Lock()
	d.pending[c] = struct{}{}
	d.busy = time.Now()
	if !d.running {
		d.running = true
		go d.run()
	}
	d.mu.Unlock()
	return c, func() {
		d.mu.Lock()
		delete(d.pending, c)
		d.mu.Unlock()
		cancel(context.Canceled)
	}
}

// run ends the pending contexts past their deadline, at every tick, until
// none has been pending for deadlinesIdle.
func (d *deadlines) run() {
	t := time.NewTicker(d.tick)
	defer t.Stop()
	var due []*boundCtx
	for now := range t.C {
		d.mu.Lock()
		for c := range d.pending {
			if !now.Before(c.deadline) {
				delete(d.pending, c)
				due = append(due, c)
			}
		}
		if len(d.pending) > 0 {
			d.busy = now
		} else if now.Sub(d.busy) >= deadlinesIdle {
			d.running = false
			d.mu.Unlock()
			return
		}
		d.mu.Unlock()
		for i, c := range due {
			c.cancel(context.DeadlineExceeded)
			due[i] = nil
		}
		due = due[:0]
	}
}

// boundCtx is a context that deadlines ends at its deadline. It reports
// that deadline, and once it has passed, context.DeadlineExceeded, as a
// context of context.WithDeadline does. It embeds a context of
// context.WithCancelCause, so that contexts made from it (and pgx's
// context.AfterFunc) attach to that one without a goroutine of their own.
type boundCtx struct {
	context.Context
	deadline time.Time
	cancel   context.CancelCauseFunc
}

// Deadline reports the deadline deadlines ends the context at.
func (c *boundCtx) Deadline() (time.Time, bool) { return c.deadline, true }

// Err is context.DeadlineExceeded once the deadline has ended the context,
// else the embedded context's error.
func (c *boundCtx) Err() error {
	err := c.Context.Err()
	if err == context.Canceled && context.Cause(c.Context) == context.DeadlineExceeded {
		return context.DeadlineExceeded
	}
	return err
}
