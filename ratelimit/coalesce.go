package ratelimit

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/pgerr"
)

// coalescer gathers the checks that callers make at the same time into one
// statement per algorithm per round trip. Every limiter on one database
// handle (a *pgxpool.Pool, or a DB of your own that wraps one) with the
// same MaxBatch and MaxInFlight shares one coalescer: the checks of a
// login's three limiters, of a global ceiling and of a per-user limit ride
// the same statement, since the statements take each key's limit and
// window with it.
//
// It is adaptive: a check that finds fewer than maxInFlight round trips
// running goes out at once, alone, as the very statement an uncoalesced
// check sends, so a lone caller pays nothing. Checks that arrive while the
// round trips are busy wait in a queue; when a round trip ends, its leader
// gives the callers it answered a moment to queue again (gather), then
// hands the queue (up to maxBatch checks) to the first waiting check, which
// sends it as one statement and becomes the next leader. Checks of one key
// in a batch are decided by one update of its row, one after another in
// arrival order (the …TakeQueue statements): a hot key's waiting checks cost
// one statement per round trip, not one each. A key's checks never ride two
// statements at once: while one is in flight, the key's later checks wait
// for the next, so every check of a key is decided after the previous one
// exactly as if they had come one after another.
type coalescer struct {
	maxBatch    int
	maxInFlight int

	batched       atomic.Uint64 // checks decided in statements of two or more
	warnedMissing atomic.Bool   // a missing queue function was logged
	// queuesOnly is set once the server refused a set-based batch statement
	// (…TakeMany) as unsupported, as a distributed PostgreSQL (Citus) does:
	// from then on every batch goes as a check queue, which it runs.
	queuesOnly atomic.Bool
	// noRuns is set once the server refused a run statement (…TakeRuns)
	// as unsupported: from then on runs go as check queues too.
	noRuns atomic.Bool
	// ranRuns counts the checks the run statements decided.
	ranRuns atomic.Uint64

	mu       sync.Mutex
	inFlight int
	busy     map[string]int // checks in flight, per row (pendingCheck.id)
	queued   map[string]int // checks in pending, per row
	progress time.Time      // when a round trip last started or ended
	pending  []*pendingCheck
	watch    *time.Timer // runs unstick while the queue may be stuck
	watching bool        // watch is armed
}

// maxQueueWait is how long the queue may go without a round trip starting
// or ending before the queued checks give up waiting and go out alone.
// Healthy round trips end well within it, so it only matters when every
// round trip in flight is stuck.
const maxQueueWait = 5 * time.Millisecond

// pendingCheck is one check waiting for, or riding, a round trip.
type pendingCheck struct {
	l    *Limiter // the limiter (or spread row) that checks
	ctx  context.Context
	key  string // the caller's key, for the deny cache
	skey []byte // the stored key, sent to the database
	id   string // the row's identity in the coalescer's maps: table and stored key
	ask  ask
	// policy: the check counts at its limiter's stored policy, read in
	// the statement (Config.Policy): a single check that asks for its
	// whole cost.
	policy bool
	// group is the all-or-nothing decision the check is part of (0: none;
	// see checkQueue), numbered per statement by send.
	group int32
	// members, when set, makes this an all-or-nothing group of checks
	// (AllowAll), queued and sent as one: its checks are these, and each
	// gets its own d and err.
	members []*pendingCheck
	// wake tells a queued check, once, what comes next: a batch to send
	// (the check is its first), or nil when d and err are set. Checks that
	// go out at once have none.
	wake chan []*pendingCheck
	d    Decision
	err  error
}

// checks returns the checks r stands for: itself, or a group's members.
func (r *pendingCheck) checks() []*pendingCheck {
	if r.members != nil {
		return r.members
	}
	return []*pendingCheck{r}
}

// alone decides r, a single check, in a statement of its own.
func (r *pendingCheck) alone(ctx context.Context) (Decision, error) {
	return r.l.takeStored(ctx, r.l.st.db, r.key, r.skey, r.ask)
}

// figures are what r counts against (see statements).
func (r *pendingCheck) figures() figures {
	f := r.l.figures()
	if r.policy {
		f.policy = r.l.cfg.Policy
	}
	return f
}

// finish tells r's caller that r.d and r.err are set.
func (r *pendingCheck) finish() {
	if r.wake != nil {
		r.wake <- nil
	}
}

func newCoalescer(maxBatch, maxInFlight int) *coalescer {
	return &coalescer{maxBatch: maxBatch, maxInFlight: maxInFlight, busy: map[string]int{}, queued: map[string]int{}}
}

// take decides one check of l, alone or in a batch.
func (c *coalescer) take(ctx context.Context, l *Limiter, key string, a ask) (Decision, error) {
	skey := l.key(key)
	r := &pendingCheck{l: l, ctx: ctx, key: key, skey: skey, id: l.alg.table() + string(skey), ask: a,
		policy: l.cfg.Policy != "" && !a.upTo}
	if err := c.submit(r); err != nil {
		return Decision{}, err
	}
	return r.d, r.err
}

// takeGroup decides the checks of one all-or-nothing group (see
// checkQueue; their group numbers are set when sent), alone or in a batch
// with other checks, and sets each check's d and err. When ctx ends first
// it returns ctx's error and the checks must not be read: the statement
// may still be deciding them.
func (c *coalescer) takeGroup(ctx context.Context, members []*pendingCheck) error {
	for _, m := range members {
		m.ctx, m.id = ctx, m.l.alg.table()+string(m.skey)
	}
	return c.submit(&pendingCheck{l: members[0].l, ctx: ctx, members: members})
}

// submit sends r (a check or a group) at once when a round trip is free
// and none of its keys is in flight, or else queues it for the next batch,
// and returns when its decisions (or errors) are set, or with the error of
// r's context when that ends first.
func (c *coalescer) submit(r *pendingCheck) error {
	c.mu.Lock()
	// Go out at once when a round trip is free and the keys are not in
	// flight; otherwise queue, for each key's row to be updated once for
	// every check waiting on it.
	if c.inFlight < c.maxInFlight && c.free(r) {
		// The key's last round trip may have ended in a denial since the
		// caller looked in the deny cache: look again before going out
		// (as a batch does for every check it takes).
		if deny := r.l.deny; deny != nil && r.members == nil {
			if d, ok := deny.get(r.key, r.ask.retryCost(), r.l.localNow()); ok {
				c.mu.Unlock()
				r.d = d
				return nil
			}
		}
		c.inFlight++
		c.count(c.busy, r, 1)
		c.progress = time.Now()
		c.mu.Unlock()
		c.lead([]*pendingCheck{r})
		return nil
	}
	r.wake = make(chan []*pendingCheck, 1)
	c.pending = append(c.pending, r)
	c.count(c.queued, r, 1)
	c.watchQueue()
	c.mu.Unlock()

	select {
	case batch := <-r.wake:
		if batch != nil {
			c.lead(batch)
		}
		return nil
	case <-r.ctx.Done():
		c.mu.Lock()
		withdrawn := c.withdraw(r)
		c.mu.Unlock()
		if !withdrawn {
			// Already in a batch: the statement may count it. If this
			// check was to lead the batch, lead it in the background.
			go c.leadIfHanded(r)
			return WithOutcome(r.ctx.Err(), OutcomeUnknown)
		}
		return mark(r.ctx.Err(), unsent)
	}
}

// free reports whether none of r's keys is in flight. The caller holds c.mu.
func (c *coalescer) free(r *pendingCheck) bool {
	for _, m := range r.checks() {
		if c.busy[m.id] > 0 {
			return false
		}
	}
	return true
}

// count adds by to the count of each of r's keys in m (c.busy or
// c.queued), deleting counts that reach zero. The caller holds c.mu.
func (c *coalescer) count(m map[string]int, r *pendingCheck, by int) {
	for _, x := range r.checks() {
		if m[x.id] += by; m[x.id] <= 0 {
			delete(m, x.id)
		}
	}
}

// leadIfHanded leads the batch handed to r, if one is, for a check whose
// caller has gone.
func (c *coalescer) leadIfHanded(r *pendingCheck) {
	if batch := <-r.wake; batch != nil {
		c.lead(batch)
	}
}

// watchQueue makes sure unstick runs within maxQueueWait while checks are
// queued. The caller holds c.mu.
func (c *coalescer) watchQueue() {
	if c.watching {
		return
	}
	c.watching = true
	if c.watch == nil {
		c.watch = time.AfterFunc(maxQueueWait, c.unstick)
	} else {
		c.watch.Reset(maxQueueWait)
	}
}

// unstick keeps the queue from waiting on round trips that are stuck (a row
// lock held by a transaction, a stalled connection): the queue moves
// whenever a round trip starts or ends, and when none has for maxQueueWait,
// every queued check goes out alone rather than queue behind them.
func (c *coalescer) unstick() {
	c.mu.Lock()
	if len(c.pending) == 0 {
		c.watching = false
		c.mu.Unlock()
		return
	}
	if idle := time.Since(c.progress); idle < maxQueueWait {
		c.watch.Reset(maxQueueWait - idle)
		c.mu.Unlock()
		return
	}
	stuck := c.pending
	c.pending = nil
	for _, r := range stuck {
		c.count(c.queued, r, -1)
		c.inFlight++
		c.count(c.busy, r, 1)
	}
	c.progress = time.Now()
	c.watching = false
	c.mu.Unlock()
	for _, r := range stuck {
		r.wake <- []*pendingCheck{r}
	}
}

// withdraw removes r from the queue; it reports false when r has already
// left it for a batch. The caller holds c.mu.
func (c *coalescer) withdraw(r *pendingCheck) bool {
	for i, p := range c.pending {
		if p == r {
			c.pending = append(c.pending[:i], c.pending[i+1:]...)
			c.count(c.queued, r, -1)
			return true
		}
	}
	return false
}

// lead sends batch, then hands the next batch to its first check.
func (c *coalescer) lead(batch []*pendingCheck) {
	c.send(batch)
	c.mu.Lock()
	c.progress = time.Now()
	for _, r := range batch {
		c.count(c.busy, r, -1)
	}
	c.gather(len(batch))
	next := c.nextBatch()
	if len(next) == 0 {
		c.inFlight--
	}
	c.mu.Unlock()
	if len(next) > 0 {
		next[0].wake <- next
	}
}

// gatherYields bounds how many times a leader yields the processor, after
// answering a batch of several checks, for their callers to queue again.
const gatherYields = 16

// gather lets the callers that the round trip just answered (answered of
// them) run before the next batch is taken: those that check again at once,
// as busy callers do, then ride the next statement instead of being left
// for the one after. It yields the processor (no timer, no sleep) until
// all of them but the leader's own caller (busy leading until the handoff)
// have queued, or gatherYields yields have passed; with nothing else to run
// a yield returns at once, so a lone caller never pays for it. The caller
// holds c.mu.
func (c *coalescer) gather(answered int) {
	if answered < 2 {
		return
	}
	want := len(c.pending) + answered - 1
	for range gatherYields {
		if len(c.pending) >= want {
			return
		}
		c.mu.Unlock()
		runtime.Gosched()
		c.mu.Lock()
	}
}

// nextBatch takes the queued checks, in arrival order, up to maxBatch of
// them, several of one key included: one statement decides a key's checks
// by one update of its row. A key in flight keeps all its queued checks
// for the batch after, as does a key whose checks did not all fit, so that
// a key's checks are always decided in arrival order. A queued check that
// the deny cache can now answer (its key was denied by the round trip that
// just ended) is answered at once and never sent, so a hot key that is
// denied costs one statement per deny period. A group is taken or kept
// whole, by the same rules for each of its keys; one larger than maxBatch
// goes in a batch of its own. The caller holds c.mu.
func (c *coalescer) nextBatch() (batch []*pendingCheck) {
	if len(c.pending) == 0 {
		return nil
	}
	taken := map[string]bool{}
	kept := map[string]bool{}
	rest := c.pending[:0]
	size := 0 // checks in batch
	for _, p := range c.pending {
		c.count(c.queued, p, -1)
		if deny := p.l.deny; deny != nil && p.members == nil {
			if d, ok := deny.get(p.key, p.ask.retryCost(), p.l.localNow()); ok {
				p.d = d
				p.finish()
				continue
			}
		}
		checks := p.checks()
		keep := size > 0 && size+len(checks) > c.maxBatch
		for _, m := range checks {
			keep = keep || kept[m.id] || (!taken[m.id] && c.busy[m.id] > 0)
		}
		if keep {
			for _, m := range checks {
				kept[m.id] = true
			}
			rest = append(rest, p)
			c.count(c.queued, p, 1)
			continue
		}
		for _, m := range checks {
			taken[m.id] = true
		}
		batch = append(batch, p)
		size += len(checks)
		c.count(c.busy, p, 1)
	}
	clear(c.pending[len(rest):])
	c.pending = rest
	return batch
}

// send runs one round trip for batch and delivers every result.
func (c *coalescer) send(batch []*pendingCheck) {
	// The statement serves several callers: no single caller's
	// cancellation may abort it, but the leader's deadline bounds it (the
	// leader answers its own caller only when the statement returns; the
	// others wait on their own contexts).
	ctx := context.WithoutCancel(batch[0].ctx)
	if dl, ok := batch[0].ctx.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = batch[0].l.st.deadlines.until(ctx, dl)
		defer cancel()
	}
	if len(batch) == 1 && batch[0].members == nil {
		r := batch[0]
		sent := r.l.localNow()
		r.d, r.err = r.alone(ctx)
		c.remember(r, sent)
		r.finish()
		return
	}
	var checks []*pendingCheck
	for g, r := range batch {
		for _, m := range r.members {
			m.group = int32(g + 1)
		}
		checks = append(checks, r.checks()...)
	}
	if len(checks) > 1 {
		c.batched.Add(uint64(len(checks)))
	}
	for _, group := range statements(checks) {
		l := group[0].l
		sent := l.localNow()
		err := c.takeMany(ctx, group)
		if errors.Is(err, errPolicyMismatch) || c.refusedWhole(l, err) {
			// The statement failed as a whole, and was rolled back (or a
			// stored policy no longer matched, and it decided nothing):
			// decide each check (each group) on its own so that every
			// error reaches the check it belongs to.
			for _, unit := range units(group) {
				if unit[0].group == 0 {
					r := unit[0]
					r.d, r.err = r.alone(ctx)
					continue
				}
				decs, uerr := unit[0].l.alg.takeQueue(ctx, unit[0].l.st.db, newCheckQueue(unit))
				for i, m := range unit {
					if uerr != nil {
						m.err = uerr
					} else {
						m.d = decs[i]
					}
				}
			}
			err = nil
		}
		for _, r := range group {
			if err != nil {
				r.err = err
			}
			if r.group == 0 {
				c.remember(r, sent)
			}
		}
	}
	for _, r := range batch {
		r.finish()
	}
}

// refusedWhole reports whether err is a coalesced statement's own failure,
// rolled back whole, on a connection that lives on: its checks can then be
// decided each on its own. Not when the server ended the connection (it is
// going away, or an operator ended the backend): every check of the batch
// gets that error and its outcome. A missing function is logged once, with
// its fix.
func (c *coalescer) refusedWhole(l *Limiter, err error) bool {
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) || statementOutcome(err, false) != OutcomeNotConsumed || connectionEnded(pgErr) {
		return false
	}
	if pgerr.IsMissingFunction(pgErr) && c.warnedMissing.CompareAndSwap(false, true) {
		l.st.opts.Logger.Warn("pgrl: a coalesced statement's function is missing, so concurrent checks go out one by one; run `rl-migrate up`",
			"limiter", l.cfg.Name, "error", pgErr.Message)
	}
	return true
}

// units splits checks into decisions: each group's consecutive checks, and
// each other check alone.
func units(checks []*pendingCheck) [][]*pendingCheck {
	var out [][]*pendingCheck
	for i := 0; i < len(checks); {
		end := i + 1
		for checks[i].group != 0 && end < len(checks) && checks[end].group == checks[i].group {
			end++
		}
		out = append(out, checks[i:end])
		i = end
	}
	return out
}

// statements splits a batch into the statements that decide it: one per
// algorithm (its table), in the order the algorithms first appear, each
// check keeping its place among its algorithm's. A statement has one clock:
// checks under a pinned clock (DatabaseOptions.Now, for tests) share a
// statement only when they read the same instant. A statement counts each
// key against one limiter's figures: a check of a key that the statement holds
// with other figures (two limiters of one name that differ, or one check
// that reads a stored policy and one that does not) starts the
// algorithm's next statement, which the round trip sends after it, so that
// a key's checks are still decided in their order.
func statements(batch []*pendingCheck) [][]*pendingCheck {
	type clockKey struct {
		alg    algorithm
		pinned bool
		at     int64
	}
	type open struct {
		group int                // index in groups of the class's latest statement
		keys  map[string]figures // the figures each of its keys counts against
	}
	var groups [][]*pendingCheck
	index := map[clockKey]*open{}
	held := func(o *open, k []byte) (figures, bool) {
		if o == nil {
			return figures{}, false
		}
		f, ok := o.keys[string(k)]
		return f, ok
	}
	for _, unit := range units(batch) {
		// A group's checks are of one algorithm and clock (see
		// oneStatement), and go in one statement.
		r := unit[0]
		k := clockKey{alg: r.l.alg}
		if at := r.l.at(); at != nil {
			k.pinned, k.at = true, at.UnixMicro()
		}
		o, ok := index[k]
		conflict := !ok
		for _, m := range unit {
			f, had := held(o, m.skey)
			conflict = conflict || had && f != m.figures()
		}
		if conflict {
			o = &open{group: len(groups), keys: map[string]figures{}}
			index[k] = o
			groups = append(groups, nil)
		}
		for _, m := range unit {
			o.keys[string(m.skey)] = m.figures()
		}
		groups[o.group] = append(groups[o.group], unit...)
	}
	return groups
}

// remember puts a denial into the deny cache before the queue is looked at
// again, so that queued checks of the same key are answered without a
// statement.
func (c *coalescer) remember(r *pendingCheck, sent time.Time) {
	if r.l.deny != nil && r.err == nil && !r.d.Allowed {
		r.l.deny.put(r.key, r.ask.retryCost(), r.d, sent)
	}
}

// takeRuns decides group's checks with the run statement when they are
// runs of lone checks of one unit (checkQueue.plainRuns): decided[i] is
// false for a check of a key without a row yet, which it did not count.
// Any other group, or every group once the server refused the statement,
// goes as a check queue, decided whole (decided is nil).
func (c *coalescer) takeRuns(ctx context.Context, l *Limiter, group []*pendingCheck) (decs []Decision, decided []bool, err error) {
	q := newCheckQueue(group)
	if c.noRuns.Load() || !q.plainRuns() {
		decs, err = l.alg.takeQueue(ctx, l.st.db, q)
		return decs, nil, err
	}
	decs, decided, err = l.alg.takeRuns(ctx, l.st.db, q)
	if err == nil {
		c.ranRuns.Add(uint64(countTrue(decided)))
	}
	if kind, pgErr := pgerr.Classify(err); kind == pgerr.Unsupported {
		// Nothing was counted: the statement was refused whole.
		if c.noRuns.CompareAndSwap(false, true) {
			l.st.opts.Logger.Info("pgrl: this server does not run the run statement, so runs of coalesced checks go as check queues",
				"limiter", l.cfg.Name, "sqlstate", pgErr.Code, "error", pgErr.Message)
		}
		decs, err = l.alg.takeQueue(ctx, l.st.db, q)
		return decs, nil, err
	}
	return decs, decided, err
}

// takeMany decides checks of one algorithm in one statement: the set-based
// batch of single checks when they are all of one limiter, each of another
// key, and each asks for all of its cost; else, when they are runs of lone
// checks of one unit, the run statement, and for keys it found without a
// row, the queue statement after it; else, or when the server does not
// support those statements, the queue statement, which updates each key's
// row once for all of its checks and takes each key's limit with it.
func (c *coalescer) takeMany(ctx context.Context, group []*pendingCheck) error {
	l := group[0].l
	simple := !c.queuesOnly.Load()
	seen := make(map[string]bool, len(group))
	for _, r := range group {
		simple = simple && r.l == l && !r.ask.upTo && r.policy == group[0].policy && !seen[r.id] && r.group == 0
		seen[r.id] = true
	}
	var decs []Decision
	var decided []bool // with a stored policy: the checks the statement decided
	var err error
	if simple {
		keys := make([][]byte, len(group))
		costs := make([]int64, len(group))
		for i, r := range group {
			keys[i], costs[i] = r.skey, r.ask.n
		}
		if group[0].policy {
			// Every check reads the policy.
			okeys := make([][]byte, len(group))
			for i, r := range group {
				okeys[i] = l.policyKey(r.key, r.skey)
			}
			decs, decided, err = l.alg.takeManyPolicy(ctx, l, l.st.db, keys, okeys, costs)
		} else {
			decs, err = l.alg.takeMany(ctx, l, l.st.db, keys, costs)
		}
		if kind, pgErr := pgerr.Classify(err); kind == pgerr.Unsupported {
			// Nothing was counted: the statement was refused whole.
			if c.queuesOnly.CompareAndSwap(false, true) {
				l.st.opts.Logger.Info("pgrl: this server does not run the set-based batch statement, so coalesced checks go as check queues",
					"limiter", l.cfg.Name, "sqlstate", pgErr.Code, "error", pgErr.Message)
			}
			simple = false
		}
	}
	if !simple {
		decs, decided, err = c.takeRuns(ctx, l, group)
	}
	if err != nil {
		return err
	}
	var rest []*pendingCheck // the run statement's undecided checks
	for i, r := range group {
		switch {
		case decided != nil && !decided[i] && !simple:
			rest = append(rest, r)
		case decided != nil && !decided[i]:
			// Its policy no longer matches: the statement left it out,
			// counting nothing. Alone, it learns why.
			r.d, r.err = r.alone(ctx)
		default:
			r.d = decs[i]
		}
	}
	if len(rest) > 0 {
		// Keys without a row yet: the check statement makes it. The
		// decided checks were counted, and keep their decisions whatever
		// becomes of these.
		decs, err := l.alg.takeQueue(ctx, l.st.db, newCheckQueue(rest))
		refused := c.refusedWhole(l, err)
		for i, r := range rest {
			switch {
			case refused:
				r.d, r.err = r.alone(ctx)
			case err != nil:
				r.err = err
			default:
				r.d = decs[i]
			}
		}
	}
	return nil
}

// countTrue is how many of bs are true.
func countTrue(bs []bool) int {
	n := 0
	for _, b := range bs {
		if b {
			n++
		}
	}
	return n
}
