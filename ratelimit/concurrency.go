package ratelimit

import (
	"context"
	"errors"
	"time"

	"github.com/pgrl/pgrl/gen"
)

// concurrency is the fourth algorithm: at most Limit slots of a key held at
// once, across every process. Each slot is a lease of Window: its process
// extends it while the work runs (slotKeeper) and releases it when the
// work ends (Slot.Release); a slot its process stopped extending (a
// process killed with kill -9) lapses after Window, and counts for nothing
// from then on. Acquire takes a slot through the same stages as every
// check (pipeline.go); there is no Allow: a place taken must be given back.
type concurrency struct{}

// MinSlotLease is the shortest Window a Concurrency limit accepts: its
// slots are extended every Window/3, each extension a statement.
const MinSlotLease = 100 * time.Millisecond

func (concurrency) validate(c Config) error {
	switch {
	case c.Window < MinSlotLease:
		return invalid(ErrInvalidWindow, "%v for %q, a concurrency limit; its Window is how long a slot outlives a holder that stopped (killed, partitioned away), and its holders extend it every Window/3: use at least %v, and 10s to a minute in production", c.Window, c.Name, MinSlotLease)
	case c.Burst != c.Limit:
		return invalid(ErrInvalidBurst, "%d for %q, a concurrency limit; it holds at most Limit slots at once: leave Burst 0", c.Burst, c.Name)
	case c.Penalty:
		return invalid(ErrInvalidOption, "Penalty for %q, a concurrency limit; a refused acquire holds nothing, so there is nothing to charge: drop Penalty", c.Name)
	case c.Spread > 1:
		return invalid(ErrInvalidOption, "Spread %d for %q, a concurrency limit; a key's slots are one row, locked by each acquire and release: use Spread 1", c.Spread, c.Name)
	case c.Policy != "":
		return invalid(ErrInvalidOption, "policy %q for %q, a concurrency limit; stored policies hold rate limits: give the concurrency limit its own Limit and Window", c.Policy, c.Name)
	case c.KeyByWindow:
		return invalid(ErrInvalidOption, "KeyByWindow for %q, a concurrency limit; its slots do not live in windows: drop KeyByWindow", c.Name)
	}
	return nil
}

func (concurrency) capacity(c Config) int64            { return c.Limit }
func (concurrency) fallbackConfig(_, fb Config) Config { return fb }
func (concurrency) spreadRow(row Config) Config        { return row }
func (concurrency) table() string                      { return "pgrl_concurrency" }
func (concurrency) partitioned() bool                  { return false }
func (concurrency) lockRank() int                      { return 3 }

// errAcquireOnly is what the counting verbs answer on a concurrency limit;
// Config.checkAsk refuses them first, with the limit's name.
var errAcquireOnly = errors.New("ratelimit: a concurrency limit is only acquired and released")

func (concurrency) take(context.Context, *Limiter, DB, []byte, int64) (Decision, error) {
	return Decision{}, errAcquireOnly
}

func (concurrency) takePolicy(context.Context, *Limiter, DB, []byte, []byte, int64) (Decision, error) {
	return Decision{}, errAcquireOnly
}

func (concurrency) takeUnderPolicy(context.Context, *Limiter, DB, []byte, int64, int64) (Decision, error) {
	return Decision{}, errAcquireOnly
}

func (concurrency) takeMany(context.Context, *Limiter, DB, [][]byte, []int64) ([]Decision, error) {
	return nil, errAcquireOnly
}

func (concurrency) takeManyPolicy(context.Context, *Limiter, DB, [][]byte, [][]byte, []int64) ([]Decision, []bool, error) {
	return nil, nil, errAcquireOnly
}

func (concurrency) takeUpTo(context.Context, *Limiter, DB, []byte, int64) (Decision, error) {
	return Decision{}, errAcquireOnly
}

func (concurrency) takeQueue(context.Context, DB, *checkQueue) ([]Decision, error) {
	return nil, errAcquireOnly
}

func (concurrency) takeRuns(context.Context, DB, *checkQueue) ([]Decision, []bool, error) {
	return nil, nil, errAcquireOnly
}

func (concurrency) refund(context.Context, *Limiter, DB, []byte, reservation, int64) (int64, error) {
	return 0, errAcquireOnly
}

// acquireSlot is an Acquire's check in the statement stage (ask.slot
// set): it takes a slot of the stored key k for token, in one statement.
func (l *Limiter) acquireSlot(ctx context.Context, db DB, k, token []byte) (Decision, error) {
	r, err := l.q.ConcurrencyAcquire(ctx, db, gen.ConcurrencyAcquireParams{
		Key: k, Token: token, At: l.at(), TtlUs: l.windowUs, MaxHeld: l.cfg.Limit,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.slotsDecision(r.Allowed, r.Held, r.NextUs, r.LastUs, r.NowUs), nil
}

func (concurrency) peek(ctx context.Context, l *Limiter, db DB, k []byte) (Decision, error) {
	r, err := l.q.ConcurrencyPeek(ctx, db, gen.ConcurrencyPeekParams{Key: k, At: l.at()})
	if err != nil {
		return Decision{}, err
	}
	return l.slotsDecision(r.Held < l.cfg.Limit, r.Held, r.NextUs, r.LastUs, r.NowUs), nil
}

func (concurrency) reset(ctx context.Context, l *Limiter, db DB, k []byte) error {
	_, err := l.q.ConcurrencyReset(ctx, db, k)
	return err
}

// slotsDecision builds a concurrency decision from the key's live slots:
// held of them, the earliest lapsing at nextUs and the latest at lastUs (0
// when none is held). A refused acquire's RetryAfter is when a place frees
// at the latest, the earliest lapse; a holder that releases frees it
// sooner, so it is a hint, not a promise. ResetAt is when every slot held
// now has lapsed at the latest.
func (s *shape) slotsDecision(allowed bool, held, nextUs, lastUs, nowUs int64) Decision {
	now := usTime(nowUs)
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Limit,
		Used:      held,
		Remaining: max(s.cfg.Limit-held, 0),
		ResetAt:   now,
		Now:       now,
		Store:     StorePostgres,
	}
	if lastUs > nowUs {
		d.ResetAt = usTime(lastUs)
	}
	if !allowed && nextUs > nowUs {
		d.RetryAfter = usTime(nextUs).Sub(now)
	}
	return d
}

// In memory (the fallback under FailToMemory), st.count is the slots held
// by this process. They are released by their holders; a process that dies
// takes them with it, so nothing lapses.

func (concurrency) fresh(*MemoryLimiter, int64) memState { return memState{} }

func (concurrency) dead(_ *MemoryLimiter, st memState, _ int64) bool { return st.count <= 0 }

func (concurrency) roll(_ *MemoryLimiter, st memState, _ int64) memState { return st }

// takeMemory holds cost more slots when they fit, or gives back -cost.
func (concurrency) takeMemory(m *MemoryLimiter, st memState, _, cost int64, _ bool) (memState, bool, int64) {
	if cost < 0 {
		st.count = max(st.count+cost, 0)
		return st, true, 0
	}
	if st.count+cost > m.cfg.Limit {
		return st, false, 0
	}
	st.count += cost
	return st, true, cost
}

func (concurrency) decideMemory(m *MemoryLimiter, allowed bool, st memState, now, _ int64) Decision {
	d := Decision{Allowed: allowed, Limit: m.cfg.Limit, Used: st.count, Remaining: max(m.cfg.Limit-st.count, 0),
		Now: usTime(now), ResetAt: usTime(now)}
	if !allowed {
		// A place frees when one of this process's holders releases it,
		// which memory cannot foresee; by then the database may answer.
		d.RetryAfter = m.cooldown
	}
	return d
}

func (c concurrency) peekMemory(m *MemoryLimiter, st memState, now int64) Decision {
	return c.decideMemory(m, st.count < m.cfg.Limit, st, now, 0)
}
