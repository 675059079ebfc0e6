package ratelimit

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// coalescer gathers the checks that one limiter's callers make at the same
// time into one statement per round trip.
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
	l           *Limiter
	maxBatch    int
	maxInFlight int

	batched atomic.Uint64 // checks decided in statements of two or more

	mu       sync.Mutex
	inFlight int
	busy     map[string]int // checks in flight, per stored key
	queued   map[string]int // checks in pending, per stored key
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
	ctx  context.Context
	key  string // the caller's key, for the deny cache
	skey []byte // the stored key, sent to the database
	id   string // string(skey): the check's key in the coalescer's maps
	ask  ask
	// wake tells a queued check, once, what comes next: a batch to send
	// (the check is its first), or nil when d and err are set. Checks that
	// go out at once have none.
	wake chan []*pendingCheck
	d    Decision
	err  error
}

// finish tells r's caller that r.d and r.err are set.
func (r *pendingCheck) finish() {
	if r.wake != nil {
		r.wake <- nil
	}
}

func newCoalescer(l *Limiter, maxBatch, maxInFlight int) *coalescer {
	return &coalescer{l: l, maxBatch: maxBatch, maxInFlight: maxInFlight, busy: map[string]int{}, queued: map[string]int{}}
}

// take decides one check, alone or in a batch.
func (c *coalescer) take(ctx context.Context, key string, a ask) (Decision, error) {
	skey := c.l.key(key)
	r := &pendingCheck{ctx: ctx, key: key, skey: skey, id: string(skey), ask: a}
	id := r.id
	c.mu.Lock()
	// Go out at once when a round trip is free and the key is not in
	// flight; otherwise queue, for the key's row to be updated once for
	// every check waiting on it.
	if c.inFlight < c.maxInFlight && c.busy[id] == 0 {
		c.inFlight++
		c.busy[id]++
		c.progress = time.Now()
		c.mu.Unlock()
		c.lead([]*pendingCheck{r})
		return r.d, r.err
	}
	r.wake = make(chan []*pendingCheck, 1)
	c.pending = append(c.pending, r)
	c.queued[id]++
	c.watchQueue()
	c.mu.Unlock()

	select {
	case batch := <-r.wake:
		if batch != nil {
			c.lead(batch)
		}
		return r.d, r.err
	case <-ctx.Done():
		c.mu.Lock()
		withdrawn := c.withdraw(r)
		c.mu.Unlock()
		if !withdrawn {
			// Already in a batch: the statement may count it. If this
			// check was to lead the batch, lead it in the background.
			go c.leadIfHanded(r)
		}
		return Decision{}, ctx.Err()
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
		c.unqueue(r.id)
		c.inFlight++
		c.busy[r.id]++
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
			c.unqueue(r.id)
			return true
		}
	}
	return false
}

// unqueue counts one check of the key id out of the queue. The caller holds c.mu.
func (c *coalescer) unqueue(id string) {
	if c.queued[id]--; c.queued[id] <= 0 {
		delete(c.queued, id)
	}
}

// lead sends batch, then hands the next batch to its first check.
func (c *coalescer) lead(batch []*pendingCheck) {
	c.send(batch)
	c.mu.Lock()
	c.progress = time.Now()
	for _, r := range batch {
		if c.busy[r.id]--; c.busy[r.id] <= 0 {
			delete(c.busy, r.id)
		}
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
// denied costs one statement per deny period. The caller holds c.mu.
func (c *coalescer) nextBatch() (batch []*pendingCheck) {
	if len(c.pending) == 0 {
		return nil
	}
	deny := c.l.deny
	now := c.l.localNow()
	taken := map[string]bool{}
	kept := map[string]bool{}
	rest := c.pending[:0]
	for _, p := range c.pending {
		c.unqueue(p.id)
		if deny != nil {
			if d, ok := deny.get(p.key, p.ask.retryCost(), now); ok {
				p.d = d
				p.finish()
				continue
			}
		}
		if kept[p.id] || (!taken[p.id] && c.busy[p.id] > 0) || len(batch) >= c.maxBatch {
			kept[p.id] = true
			rest = append(rest, p)
			c.queued[p.id]++
			continue
		}
		taken[p.id] = true
		batch = append(batch, p)
		c.busy[p.id]++
	}
	clear(c.pending[len(rest):])
	c.pending = rest
	return batch
}

// send runs one round trip for batch and delivers every result.
func (c *coalescer) send(batch []*pendingCheck) {
	l := c.l
	// The statement serves several callers: no single caller's
	// cancellation may abort it, but the leader's deadline bounds it (the
	// leader answers its own caller only when the statement returns; the
	// others wait on their own contexts).
	ctx := context.WithoutCancel(batch[0].ctx)
	if dl, ok := batch[0].ctx.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	sent := l.localNow()
	if len(batch) == 1 {
		r := batch[0]
		r.d, r.err = l.takeKey(ctx, l.db, r.skey, r.ask)
		c.remember(r, sent)
		r.finish()
		return
	}
	c.batched.Add(uint64(len(batch)))
	err := c.takeMany(ctx, batch)
	var pgErr *pgconn.PgError
	if err != nil && errors.As(err, &pgErr) {
		// The statement failed as a whole: decide each check on its own so
		// that every error reaches the check it belongs to.
		for _, r := range batch {
			r.d, r.err = l.takeKey(ctx, l.db, r.skey, r.ask)
		}
		err = nil
	}
	for _, r := range batch {
		if err != nil {
			r.err = err
		}
		c.remember(r, sent)
		r.finish()
	}
}

// remember puts a denial into the deny cache before the queue is looked at
// again, so that queued checks of the same key are answered without a
// statement.
func (c *coalescer) remember(r *pendingCheck, sent time.Time) {
	if c.l.deny != nil && r.err == nil && !r.d.Allowed {
		c.l.deny.put(r.key, r.ask.retryCost(), r.d, sent)
	}
}

// takeMany decides the batch in one statement: the set-based batch of
// single checks when every check is of another key and asks for all of
// its cost, else the queue statement, which updates each key's row once
// for all of its checks.
func (c *coalescer) takeMany(ctx context.Context, batch []*pendingCheck) error {
	l := c.l
	keys := make([][]byte, len(batch))
	asks := make([]ask, len(batch))
	queue := false
	seen := make(map[string]bool, len(batch))
	for i, r := range batch {
		keys[i], asks[i] = r.skey, r.ask
		queue = queue || r.ask.upTo || seen[r.id]
		seen[r.id] = true
	}
	var decs []Decision
	var err error
	if queue {
		decs, err = l.alg.takeQueue(ctx, l, l.db, newCheckQueue(keys, asks))
	} else {
		costs := make([]int64, len(batch))
		for i, a := range asks {
			costs[i] = a.n
		}
		decs, err = l.alg.takeMany(ctx, l, l.db, keys, costs)
	}
	if err != nil {
		return err
	}
	for i, r := range batch {
		r.d = decs[i]
	}
	return nil
}
