package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/gen"
)

// Errors a Slot reports through Err once it is no longer held.
var (
	// ErrSlotReleased: the slot was given back by Release or ReleaseTx.
	ErrSlotReleased = errors.New("ratelimit: slot released")
	// ErrSlotLost: the slot lapsed before it was released: its lease
	// (the limit's Window) ran out without an extension confirmed by
	// PostgreSQL (the database was unreachable or too slow for a whole
	// Window, or the key was Reset), so another holder may have its place.
	// Work done under it should stop.
	ErrSlotLost = errors.New("ratelimit: slot lost: its lease lapsed before it was released")
)

// Slot is a place of a concurrency limit (Algorithm Concurrency) that this
// process holds, from Acquire until Release. While it is held, the
// Database extends its lease in PostgreSQL, in one statement per interval
// for every slot the process holds; a slot whose extension could not be
// confirmed before its lease ran out is lost (Done is closed and Err is
// ErrSlotLost). Its methods are safe for concurrent use.
//
// A Slot that becomes unreachable without being released (a forgotten
// Release) is released when the garbage collector finds it, with a
// warning in the Database's Logger: a leaked slot is not extended forever.
type Slot struct {
	h *slotLease
}

// slotLease is a Slot's state, which the Database's keeper and the lease's
// timer hold: apart from the Slot, so that a Slot nobody holds any more can
// be collected, and released then.
type slotLease struct {
	l     *Limiter       // nil for a MemoryLimiter's slot
	m     *MemoryLimiter // holds the slot when store is StoreMemory
	key   string         // the caller's key
	k     []byte         // the stored key
	token []byte         // the slot's token in PostgreSQL
	store Store          // where the slot is held: StorePostgres, StoreMemory, or StorePolicy for nowhere

	mu       sync.Mutex
	err      error       // nil while held
	deadline time.Time   // local: when the lease runs out unless extended
	timer    *time.Timer // fires at deadline
	done     chan struct{}
}

// Acquire takes a slot of key from a concurrency limit: at most Limit held
// at once across every process using the limit. When the Decision is
// allowed, the returned Slot is held until its Release (call it, with a
// context that outlives the request's, when the work ends: defer
// slot.Release(context.WithoutCancel(ctx))); when it is not, the Slot is
// nil and Decision.RetryAfter is a hint, the time until a place frees at the
// latest (holders that release free theirs sooner). Like Allow, it goes
// through the limiter's failure policy when PostgreSQL cannot answer: under
// FailToMemory the slot is held in this process's memory (Decision.Store
// says so), under FailOpen it is held nowhere. Errors carry an Outcome: a
// slot whose acquire was consumed but whose answer was lost is held by no
// one and lapses after Window.
func (l *Limiter) Acquire(ctx context.Context, key string) (*Slot, Decision, error) {
	return l.acquire(ctx, nil, key)
}

// AcquireTx is Acquire inside the caller's transaction: the slot is taken
// when the transaction commits, and rolling it back gives it back (the Slot
// is then lost at its first extension). The key's row stays locked until
// the transaction ends: other acquires and releases of the key, and this
// process's extensions of every slot it holds, wait for it. The lease
// counts from the transaction's start (PostgreSQL's now()), not the
// call's. Keep such transactions well under a third of the Window. There
// is no failure policy: errors are returned.
func (l *Limiter) AcquireTx(ctx context.Context, tx pgx.Tx, key string) (*Slot, Decision, error) {
	if tx == nil {
		return nil, Decision{}, WithOutcome(ErrNilDB, OutcomeNotConsumed)
	}
	return l.acquire(ctx, tx, key)
}

func (l *Limiter) acquire(ctx context.Context, tx pgx.Tx, key string) (*Slot, Decision, error) {
	if l.cfg.Algorithm != Concurrency {
		return nil, Decision{}, WithOutcome(invalid(ErrInvalidOption, "Acquire on %q, a %s limit; slots are held from a Concurrency limit: use Allow to count a rate", l.cfg.Name, l.cfg.Algorithm), OutcomeNotConsumed)
	}
	keeper := l.st.slotKeeper()
	token := keeper.token()
	sent := time.Now()
	d, err := l.check(ctx, tx, key, ask{n: 1, slot: token})
	if err != nil || !d.Allowed {
		return nil, d, err
	}
	h := &slotLease{l: l, m: l.memory, key: key, k: l.key(key), token: token, store: d.Store, done: make(chan struct{})}
	switch {
	case d.ShadowDenied:
		h.store = StorePolicy // a shadow limit's refusal holds nothing
	case d.Store == StorePostgres && !time.Now().Before(l.leaseEnd(sent)):
		// The answer came after the lease it granted had run out (the
		// acquire waited longer than the Window): the place may be
		// another's already. Not held; freed at once, best effort.
		h.store = StorePolicy
		h.releaseLater()
		d.Allowed, d.Granted, d.RetryAfter = false, 0, 0
		d.Reason = fmt.Sprintf("the acquire was answered %v after it was sent, when its lease of %v had run out: not held; try again", time.Since(sent).Round(time.Millisecond), l.cfg.Window)
		return nil, d, nil
	case d.Store == StorePostgres:
		keeper.keep(h, sent)
	}
	return newSlot(h), d, nil
}

// leaseEnd is when a slot confirmed by a statement sent at sent counts as
// lapsed here: its Window later, less a twentieth of it. PostgreSQL keeps
// the slot a Window after the statement's own instant, later still, so
// the margin is the time a holder has to stop its work after Done closes
// before another may take the place.
func (l *Limiter) leaseEnd(sent time.Time) time.Time {
	return sent.Add(l.cfg.Window - l.cfg.Window/20)
}

// newSlot is the Slot of h, released by the garbage collector if it is
// dropped while held.
func newSlot(h *slotLease) *Slot {
	s := &Slot{h: h}
	runtime.AddCleanup(s, (*slotLease).abandon, h)
	return s
}

// Done is closed when the slot is no longer held: released, or lost.
func (s *Slot) Done() <-chan struct{} { return s.h.done }

// Err is nil while the slot is held, then ErrSlotReleased or ErrSlotLost.
// After Release it is ErrSlotLost too when PostgreSQL no longer held the
// slot by then: it had lapsed (its holder was cut off from PostgreSQL, or
// stalled, for longer than the margin before Done could close), so the
// hold was not exclusive to its end.
func (s *Slot) Err() error {
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	return s.h.err
}

// Key is the key the slot was acquired for.
func (s *Slot) Key() string { return s.h.key }

// Release gives the slot back. Releasing again, or releasing a slot that
// was lost, does nothing and returns nil. A slot PostgreSQL no longer held
// (it had lapsed) returns nil too, and Err reports ErrSlotLost. When
// PostgreSQL cannot be reached (within the Database's Timeout), the error
// is returned and the slot, no longer extended, lapses after the Window:
// the key holds one place too few until then, never one too many.
func (s *Slot) Release(ctx context.Context) error { return s.h.giveBack(ctx, nil) }

// giveBack is Release (tx nil: on the Database, within its Timeout) and
// ReleaseTx.
func (s *slotLease) giveBack(ctx context.Context, tx pgx.Tx) error {
	if !s.end(ErrSlotReleased) {
		return nil
	}
	switch s.store {
	case StorePostgres:
		call, db := ctx, DB(tx)
		if tx == nil {
			cctx, cancel := context.WithTimeout(ctx, s.l.st.opts.Timeout)
			defer cancel()
			call, db = cctx, s.l.st.db
		}
		held, err := s.release(call, db)
		if err == nil && !held {
			s.mu.Lock()
			s.err = ErrSlotLost
			s.mu.Unlock()
		}
		return s.l.explain(ctx, err)
	case StoreMemory:
		s.m.give(s.key)
	}
	return nil
}

// ReleaseTx is Release inside the caller's transaction: rolling it back
// keeps the slot in PostgreSQL until its lease lapses (no longer extended).
func (s *Slot) ReleaseTx(ctx context.Context, tx pgx.Tx) error {
	if tx == nil {
		return ErrNilDB
	}
	return s.h.giveBack(ctx, tx)
}

// Acquire takes a slot of key from a concurrency limit kept in this
// process's memory: at most Limit held at once by this process. The Slot
// is held until its Release; it is never lost (nothing lapses in memory).
// A refusal's RetryAfter is zero: a place frees when a holder releases it.
func (m *MemoryLimiter) Acquire(_ context.Context, key string) (*Slot, Decision, error) {
	if m.cfg.Algorithm != Concurrency {
		return nil, Decision{}, WithOutcome(invalid(ErrInvalidOption, "Acquire on %q, a %s limit; slots are held from a Concurrency limit: use Allow to count a rate", m.cfg.Name, m.cfg.Algorithm), OutcomeNotConsumed)
	}
	d, err := m.observe(key, ask{n: 1, slot: []byte{}})
	if err != nil || !d.Allowed {
		return nil, d, WithOutcome(err, OutcomeNotConsumed)
	}
	h := &slotLease{m: m, key: key, store: StoreMemory, done: make(chan struct{})}
	if d.ShadowDenied {
		h.store = StorePolicy
	}
	return newSlot(h), d, nil
}

// release gives the slot back in PostgreSQL; held reports whether it
// still held it (no row: it had lapsed, or the key was reset).
func (s *slotLease) release(ctx context.Context, db DB) (held bool, err error) {
	n, err := s.l.q.ConcurrencyRelease(ctx, db, gen.ConcurrencyReleaseParams{Key: s.k, Token: s.token, At: s.l.at()})
	return n > 0, err
}

// end marks the slot no longer held, for err; false when it already was.
func (s *slotLease) end(err error) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return false
	}
	s.err = err
	if s.timer != nil {
		s.timer.Stop()
	}
	close(s.done)
	if s.store == StorePostgres {
		s.l.st.slotKeeper().drop(s)
	}
	return true
}

// extend moves the slot's local deadline to until, once PostgreSQL
// confirmed the lease to at least then.
func (s *slotLease) extend(until time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil || !until.After(s.deadline) {
		return
	}
	s.deadline = until
	s.timer.Reset(time.Until(until))
}

// lapse is the deadline's timer: the lease ran out unconfirmed. The slot
// may still be live in PostgreSQL (the extension went through, its answer
// did not come back in time), so it is released there too, best effort,
// to free the place for others now rather than at its lapse.
func (s *slotLease) lapse() {
	s.mu.Lock()
	late := s.err == nil && !time.Now().Before(s.deadline)
	s.mu.Unlock()
	if !late || !s.end(ErrSlotLost) {
		return
	}
	s.releaseLater()
}

// releaseLater sends the slot's release in the background, bounded by the
// Database's Timeout, for a slot that may still be live in PostgreSQL
// though this process no longer counts it.
func (s *slotLease) releaseLater() {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.l.st.opts.Timeout)
		defer cancel()
		_, _ = s.release(ctx, s.l.st.db)
	}()
}

// abandon releases a slot whose Slot was collected while still held.
func (s *slotLease) abandon() {
	s.mu.Lock()
	held := s.err == nil
	s.mu.Unlock()
	if !held {
		return
	}
	logger := slog.Default()
	name := ""
	switch {
	case s.l != nil:
		logger, name = s.l.st.opts.Logger, s.l.cfg.Name
	case s.m != nil:
		logger, name = s.m.logger, s.m.cfg.Name
	}
	logger.Warn("pgrl: a slot was dropped without Release; releasing it now (release every slot: defer slot.Release)",
		"limit", name)
	go func() { _ = s.giveBack(context.Background(), nil) }() // bounded by the Database's Timeout
}

// lost marks the slot lost: an extension found it no longer live.
func (s *slotLease) lost() { s.end(ErrSlotLost) }

// slotKeeper extends the leases of the slots a Database's limiters hold,
// in one statement per interval (a third of the shortest Window among
// them) for all of them, and tells each slot what became of it.
type slotKeeper struct {
	st     *Database
	holder [8]byte // names this process in the slots' tokens

	mu      sync.Mutex
	seq     uint64
	slots   map[*slotLease]struct{}
	running bool
	every   time.Duration // the interval run keeps to now
	kick    chan struct{} // a slot was kept whose Window is shorter than every allows
}

func newSlotKeeper(st *Database) *slotKeeper {
	k := &slotKeeper{st: st, slots: map[*slotLease]struct{}{}, kick: make(chan struct{}, 1)}
	_, _ = rand.Read(k.holder[:])
	return k
}

// slotKeeper returns the Database's keeper, made on first use.
func (s *Database) slotKeeper() *slotKeeper {
	s.keeperOnce.Do(func() { s.keeper = newSlotKeeper(s) })
	return s.keeper
}

// token returns a new slot's token: the process's 8 bytes, then a count.
func (k *slotKeeper) token() []byte {
	k.mu.Lock()
	k.seq++
	n := k.seq
	k.mu.Unlock()
	t := make([]byte, 16)
	copy(t, k.holder[:])
	binary.BigEndian.PutUint64(t[8:], n)
	return t
}

// keep starts extending s, acquired by a statement sent at sent: its lease
// runs out a Window after that, unless extended.
func (k *slotKeeper) keep(s *slotLease, sent time.Time) {
	s.mu.Lock()
	s.deadline = s.l.leaseEnd(sent)
	s.timer = time.AfterFunc(time.Until(s.deadline), s.lapse)
	s.mu.Unlock()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.slots[s] = struct{}{}
	if !k.running {
		k.running = true
		k.every = s.l.cfg.Window / 3
		go k.run()
		return
	}
	if s.l.cfg.Window/3 < k.every {
		k.every = s.l.cfg.Window / 3
		select {
		case k.kick <- struct{}{}:
		default:
		}
	}
}

// drop stops extending s.
func (k *slotKeeper) drop(s *slotLease) {
	k.mu.Lock()
	delete(k.slots, s)
	k.mu.Unlock()
}

// run extends the slots held until none is; keep starts it again. It
// extends every slot each interval, a third of the shortest Window among
// them, counted from one extension's start to the next, and gives each up
// to an interval (renew): so one extension can fail, even by hanging, and
// the next still confirms a slot before its lease runs out here
// (leaseEnd). After a failed extension the next one goes a tenth of an
// interval later, not a whole one, so that a slow moment of the database
// (a busy machine) costs a slot only when it outlasts the lease.
func (k *slotKeeper) run() {
	every, ok := k.interval()
	next := time.Now().Add(every)
	for ok {
		select {
		case <-time.After(time.Until(next)):
			start := time.Now()
			renewed := k.renew(every)
			every, ok = k.interval()
			if next = start.Add(every); !renewed {
				next = time.Now().Add(every / 10)
			}
		case <-k.kick:
			// A slot of a shorter Window may need its extension sooner.
			if every, ok = k.interval(); ok && time.Now().Add(every).Before(next) {
				next = time.Now().Add(every)
			}
		}
	}
}

// interval is a third of the shortest Window among the slots held; false
// when none is held, and then the keeper stops (under the lock, so that
// keep starts it again).
func (k *slotKeeper) interval() (time.Duration, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var every time.Duration
	for s := range k.slots {
		if w := s.l.cfg.Window / 3; every == 0 || w < every {
			every = w
		}
	}
	if every == 0 {
		k.running = false
		return 0, false
	}
	k.every = every
	return every, true
}

// renew sends one extension for every slot held, bounded by interval and
// by the soonest local deadline among them (an answer after it comes too
// late for that slot). It reports whether the extension got an answer.
func (k *slotKeeper) renew(interval time.Duration) bool {
	k.mu.Lock()
	held := make([]*slotLease, 0, len(k.slots))
	for s := range k.slots {
		held = append(held, s)
	}
	k.mu.Unlock()
	if len(held) == 0 {
		return true
	}
	bound := interval
	for _, s := range held {
		s.mu.Lock()
		bound = min(bound, time.Until(s.deadline))
		s.mu.Unlock()
	}
	// A slot past its deadline is its timer's to end; the others still
	// get a short try.
	bound = max(bound, interval/10)
	p := gen.ConcurrencyRenewParams{Holder: k.holder[:], At: held[0].l.at()}
	for _, s := range held {
		p.Keys = append(p.Keys, s.k)
		p.Tokens = append(p.Tokens, s.token)
		p.TtlsUs = append(p.TtlsUs, s.l.windowUs)
	}
	sent := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	rows, err := gen.New().ConcurrencyRenew(ctx, k.st.db, p)
	cancel()
	if err != nil {
		// Each slot's timer ends it if no extension gets through in time.
		k.st.opts.Logger.Debug("pgrl: extending the slots held failed; retrying", "slots", len(held), "err", err)
		return false
	}
	live := map[string]bool{}
	for _, r := range rows {
		for _, t := range r.Tokens {
			live[string(r.Key)+string(t)] = true
		}
	}
	for _, s := range held {
		if live[string(s.k)+string(s.token)] {
			s.extend(s.l.leaseEnd(sent))
		} else {
			s.lost()
		}
	}
	return true
}
