package ratelimit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// Check is one limit of a multi-limit decision.
type Check struct {
	// Limiter is the limit to check. Required.
	Limiter *Limiter
	// Key is the key to check it for.
	Key string
	// Cost is the units the check asks for. Defaults to 1.
	Cost int64
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

// batcher is what sends a pgx.Batch: a pool, a connection or a transaction.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// AllowAll decides several limits at once (for example a login's per
// email+IP, per IP and per email limits, or a per-IP limit and a global
// ceiling) in one round trip and one transaction. Algorithms may be mixed;
// the limiters must share one database. The rows are locked in one fixed
// order (by table, then stored key), so concurrent decisions over
// overlapping keys never deadlock.
//
// Under AllOrNothing, the checks run and a last statement aborts the
// transaction unless all allowed, so a denied request consumes nothing;
// limiters in shadow mode are left out of that vote. When the database
// fails, each check is answered by its own limiter's failure policy.
// AllowAllTx does the same inside the caller's transaction.
func AllowAll(ctx context.Context, mode MultiMode, checks ...Check) (MultiDecision, error) {
	return observeAll(mode, checks, func() (MultiDecision, error) { return allowAll(ctx, nil, mode, checks) })
}

// AllowAllTx is AllowAll inside the caller's transaction: rolling the
// transaction back refunds every unit it consumed, and the limiters'
// databases are not used for the checks (they need not be the same). The
// checks run under a savepoint, released when the batch succeeds and
// rolled back when it fails or, under AllOrNothing, when a limit denies,
// so the caller's transaction stays usable either way; that costs two more
// round trips than AllowAll. As with AllowNTx, there is no failure policy,
// breaker, deny cache or Config.Timeout: errors are returned, and the rows
// stay locked until the transaction ends. In the partitioned layout, a
// missing partition is created outside the transaction (with
// CreatePartitions) and ErrPartitionMissing asks for a retry.
func AllowAllTx(ctx context.Context, tx pgx.Tx, mode MultiMode, checks ...Check) (MultiDecision, error) {
	if tx == nil {
		return MultiDecision{}, ErrNilDB
	}
	return observeAll(mode, checks, func() (MultiDecision, error) { return allowAll(ctx, tx, mode, checks) })
}

// observeAll runs decide and reports its outcome to each check's observer.
func observeAll(mode MultiMode, checks []Check, decide func() (MultiDecision, error)) (MultiDecision, error) {
	start := time.Now()
	m, err := decide()
	took := time.Since(start)
	for i := range m.Decisions {
		if i < len(checks) {
			// What each check took: its cost where it was allowed, unless
			// AllOrNothing refused the request as a whole.
			cost := checks[i].Cost
			if cost == 0 {
				cost = 1 // Check.Cost's default, as allowAll applies it
			}
			d := ask{n: cost}.settle(m.Decisions[i])
			if !m.Allowed && mode == AllOrNothing {
				d.Granted = 0
			}
			m.Decisions[i] = d
		}
	}
	for i, c := range checks {
		if c.Limiter == nil || c.Limiter.cfg.Observer == nil {
			continue
		}
		var d Decision
		if i < len(m.Decisions) {
			d = m.Decisions[i]
		}
		c.Limiter.cfg.Observer.ObserveDecision(c.Limiter.cfg.Name, d, took, err)
	}
	return m, err
}

// allowAll decides checks in one batch: on the limiters' database with the
// failure policies when tx is nil, else under a savepoint of tx.
func allowAll(ctx context.Context, tx pgx.Tx, mode MultiMode, checks []Check) (MultiDecision, error) {
	if len(checks) == 0 {
		return MultiDecision{}, ErrEmptyMulti
	}
	if mode != AllOrNothing && mode != ConsumeAll {
		return MultiDecision{}, invalid(ErrInvalidMultiMode, "%d; use AllOrNothing or ConsumeAll", mode)
	}
	type item struct {
		i    int
		c    Check
		skey []byte
	}
	items := make([]item, len(checks))
	seen := map[string]int{}
	var db DB
	for i, c := range checks {
		if c.Limiter == nil {
			return MultiDecision{}, invalid(ErrNilLimiter, "check %d", i)
		}
		if c.Cost == 0 {
			c.Cost = 1
		}
		if err := c.Limiter.cfg.checkCost(c.Cost); err != nil {
			return MultiDecision{}, fmt.Errorf("check %d: %w", i, err)
		}
		if err := c.Limiter.cfg.checkKey(c.Key); err != nil {
			return MultiDecision{}, fmt.Errorf("check %d: %w", i, err)
		}
		if c.Limiter.shards != nil {
			// A spread limit is decided by one of its rows.
			c.Limiter = c.Limiter.pickShard(c.Cost)
		}
		if err := c.Limiter.cfg.checkCost(c.Cost); err != nil {
			return MultiDecision{}, fmt.Errorf("check %d: %w", i, err)
		}
		if i == 0 {
			db = c.Limiter.db
		} else if c.Limiter.db != db && tx == nil {
			return MultiDecision{}, invalid(ErrMixedDatabases, "check %d (%q) uses another database than check 0", i, c.Limiter.cfg.Name)
		}
		skey := c.Limiter.key(c.Key)
		id := string(c.Limiter.cfg.Algorithm) + "\x00" + string(skey)
		if j, dup := seen[id]; dup {
			return MultiDecision{}, invalid(ErrDuplicateCheck, "checks %d and %d (%q, same key); merge them into one check with the summed cost", j, i, c.Limiter.cfg.Name)
		}
		seen[id] = i
		items[i] = item{i: i, c: c, skey: skey}
	}
	out := MultiDecision{Decisions: make([]Decision, len(checks)), DeniedBy: -1}

	// A denial this process already knows of decides without a round trip
	// (only when nothing would be consumed anyway).
	if mode == AllOrNothing && tx == nil {
		for _, it := range items {
			l := it.c.Limiter
			if l.deny == nil || l.cfg.Shadow {
				continue
			}
			if d, ok := l.deny.get(it.c.Key, it.c.Cost, l.localNow()); ok {
				for j, other := range items {
					out.Decisions[j] = Decision{Allowed: true, Limit: other.c.Limiter.cfg.capacity(), Store: StoreDenyCache,
						Now: d.Now, Reason: "not checked: another limit of the decision denied"}
				}
				out.Decisions[it.i] = d
				out.DeniedBy = it.i
				return out, nil
			}
		}
	}

	// Deterministic lock order: fixed window, token bucket, sliding window
	// tables in that order, keys in byte order within each.
	order := slices.Clone(items)
	slices.SortFunc(order, func(a, b item) int {
		if c := a.c.Limiter.alg.lockRank() - b.c.Limiter.alg.lockRank(); c != 0 {
			return c
		}
		return bytes.Compare(a.skey, b.skey)
	})

	first := checks[0].Limiter
	sent := first.localNow()
	var sp pgx.Tx // the savepoint, in the caller's transaction
	var probe int64
	if tx != nil {
		var err error
		if sp, err = tx.Begin(ctx); err != nil {
			return MultiDecision{}, first.explain(ctx, err)
		}
		db = sp
	} else {
		var ok bool
		if probe, ok = first.breaker.allow(sent); !ok {
			return fallbackAll(ctx, checks, errBreakerOpen)
		}
	}
	cctx := ctx
	if tx == nil {
		var cancel context.CancelFunc
		cctx, cancel = context.WithTimeout(ctx, first.cfg.Timeout)
		defer cancel()
	}
	if tx == nil && mode == AllOrNothing {
		// On Citus a batch's implicit transaction does not make the vote's
		// abort undo the checks before it: the batch goes in a transaction
		// of its own, committed or rolled back as the savepoint is.
		t, err := first.citusTx(cctx, db)
		if err != nil {
			err = first.explain(ctx, err)
			if IsConfigError(err) {
				return MultiDecision{}, err
			}
			first.breaker.failure(time.Now(), err, first.cfg.OnFailure, probe)
			return fallbackAll(ctx, checks, err)
		}
		if t != nil {
			sp, db = t, t
		}
	}

	// One statement per algorithm: the checks of limiters that share a
	// table (and a clock) go in one queue statement, which takes each key's
	// limit with it; a spread limit's check picks its row and goes alone.
	stmts := make([]*deferred, 0, len(order)+1)
	type groupResult struct {
		decs []Decision
		err  error
	}
	var spans [][2]int // [start, end) of order, one per statement
	for k := 0; k < len(order); {
		end := k + 1
		for l := order[k].c.Limiter; end < len(order) && l.shards == nil; end++ {
			m := order[end].c.Limiter
			if m.shards != nil || m.alg != l.alg || !sameClock(l, m) {
				break
			}
		}
		spans = append(spans, [2]int{k, end})
		k = end
	}
	results := make([]chan groupResult, len(spans))
	for g, span := range spans {
		d := newDeferred()
		stmts = append(stmts, d)
		results[g] = make(chan groupResult, 1)
		group := order[span[0]:span[1]]
		go func() {
			if len(group) == 1 {
				it := group[0]
				dec, err := it.c.Limiter.take(cctx, d, it.c.Key, ask{n: it.c.Cost})
				results[g] <- groupResult{[]Decision{dec}, err}
				return
			}
			checks := make([]*pendingCheck, len(group))
			for i, it := range group {
				checks[i] = &pendingCheck{l: it.c.Limiter, key: it.c.Key, skey: it.skey, ask: ask{n: it.c.Cost}}
			}
			decs, err := group[0].c.Limiter.alg.takeQueue(cctx, d, newCheckQueue(checks))
			if err == nil {
				for i := range decs {
					decs[i].Store = StorePostgres
				}
			} else {
				decs = make([]Decision, len(group))
			}
			results[g] <- groupResult{decs, err}
		}()
	}
	var vote *deferred
	if mode == AllOrNothing {
		// Empty arrays, not nil ones: pgx sends nil as NULL.
		p := sqlops.MultiRequireAllowedParams{
			FixedWindowKeys: [][]byte{}, FixedWindowWindowsUs: []int64{},
			TokenBucketKeys: [][]byte{}, SlidingWindowKeys: [][]byte{},
			AtUs: first.atUs(),
		}
		for _, it := range order {
			l := it.c.Limiter
			if l.cfg.Shadow {
				continue
			}
			l.alg.vote(&p, l, it.skey)
		}
		vote = newDeferred()
		stmts = append(stmts, vote)
		go func() { _, _ = sqlops.New().MultiRequireAllowed(cctx, vote, p) }()
	}

	b := &pgx.Batch{}
	for _, s := range stmts {
		<-s.queued
		b.Queue(s.sql, s.args...)
	}
	sendErr := runBatch(cctx, db, b, stmts)

	decs := make([]Decision, 0, len(order))
	var firstErr error
	for g := range spans {
		r := <-results[g]
		decs = append(decs, r.decs...)
		if r.err != nil && firstErr == nil {
			firstErr = r.err
		}
	}
	if vote != nil && sendErr == nil {
		sendErr = vote.err
	}
	denied := vote != nil && pgerr.IsMultiDenied(sendErr)
	if denied {
		sendErr = nil
	}
	if sendErr == nil {
		sendErr = firstErr
	}
	if sp != nil {
		// Keep what the batch did only when it succeeded and was not voted
		// down; either way the caller's transaction stays usable. A
		// transaction of the decision's own (on Citus) ends within its
		// Timeout.
		endCtx := ctx
		if tx == nil {
			endCtx = cctx
		}
		var spErr error
		if sendErr != nil || denied {
			spErr = sp.Rollback(endCtx)
		} else {
			spErr = sp.Commit(endCtx)
		}
		if sendErr == nil && spErr != nil {
			sendErr = spErr
		}
	}
	if sendErr != nil {
		if callerDone(ctx) {
			return MultiDecision{}, fmt.Errorf("ratelimit: %w", callerErr(ctx))
		}
		err := first.explain(ctx, sendErr)
		if IsConfigError(err) || isMissingPartition(sendErr) {
			if isMissingPartition(sendErr) && !slices.ContainsFunc(order, func(it item) bool {
				l := it.c.Limiter
				return l.alg.partitioned() && !l.cfg.CreatePartitions
			}) {
				// Create the partitions and decide again.
				for _, it := range order {
					if it.c.Limiter.alg.partitioned() {
						// Outside the caller's transaction, if any.
						if herr := it.c.Limiter.heal(ctx, it.c.Limiter.db); herr != nil {
							return MultiDecision{}, mapErr(herr)
						}
					}
				}
				return allowAll(ctx, tx, mode, checks)
			}
			return MultiDecision{}, err
		}
		if tx != nil {
			return MultiDecision{}, err
		}
		first.breaker.failure(time.Now(), err, first.cfg.OnFailure, probe)
		return fallbackAll(ctx, checks, err)
	}
	if tx == nil {
		first.breaker.success(probe)
	}

	voteLost := false
	for k, it := range order {
		voteLost = voteLost || (!decs[k].Allowed && !it.c.Limiter.cfg.Shadow)
	}
	if denied && !voteLost {
		// The vote aborted the batch although every counted check allowed:
		// nothing was consumed, so the decision cannot be "allowed".
		return MultiDecision{}, errors.New("ratelimit: multi-limit batch rolled back although every limit allowed; nothing was consumed")
	}
	out.Allowed = true
	for k, it := range order {
		d := decs[k]
		l := it.c.Limiter
		if !d.Allowed && l.deny != nil && tx == nil {
			l.deny.put(it.c.Key, it.c.Cost, d, sent)
		}
		d = l.shadow(it.c.Key, d)
		out.Decisions[it.i] = d
		if !d.Allowed {
			out.Allowed = false
			if out.DeniedBy < 0 || it.i < out.DeniedBy {
				out.DeniedBy = it.i
			}
		}
	}
	return out, nil
}

// citusTx returns a transaction begun on db when db is a Citus coordinator,
// and nil otherwise. Whether it is one is asked once per limiter.
func (l *Limiter) citusTx(ctx context.Context, db DB) (pgx.Tx, error) {
	switch l.citus.Load() {
	case citusNo:
		return nil, nil
	case citusUnknown:
		var ok bool
		if err := db.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')").Scan(&ok); err != nil {
			return nil, err
		}
		if !ok {
			l.citus.Store(citusNo)
			return nil, nil
		}
		l.citus.Store(citusYes)
	}
	b, ok := db.(interface {
		Begin(context.Context) (pgx.Tx, error)
	})
	if !ok {
		return nil, invalid(ErrUnsupported, "an AllOrNothing decision on Citus runs in a transaction, and %T cannot begin one: pass a *pgxpool.Pool or a *pgx.Conn, or use AllowAllTx", db)
	}
	return b.Begin(ctx)
}

// What Limiter.citus holds.
const (
	citusUnknown int32 = iota
	citusNo
	citusYes
)

// fallbackAll answers every check by its limiter's failure policy.
func fallbackAll(ctx context.Context, checks []Check, cause error) (MultiDecision, error) {
	out := MultiDecision{Allowed: true, Decisions: make([]Decision, len(checks)), DeniedBy: -1}
	for i, c := range checks {
		cost := c.Cost
		if cost == 0 {
			cost = 1
		}
		d, err := c.Limiter.fallback(ctx, c.Key, ask{n: cost}, cause)
		if err != nil {
			return MultiDecision{}, err
		}
		out.Decisions[i] = d
		if !d.Allowed {
			out.Allowed = false
			if out.DeniedBy < 0 {
				out.DeniedBy = i
			}
		}
	}
	return out, nil
}

// deferred is a gen.DBTX that, instead of running a generated query,
// records its SQL and arguments so that several queries go out in one
// pgx.Batch, and then blocks the generated code's Scan until the batch's
// result for that query arrives. This keeps the SQL in one place, the gen
// package, for single checks and batches alike.
type deferred struct {
	sql    string
	args   []any
	dest   []any         // a QueryRow's Scan destinations
	many   bool          // a Query: rows instead of dest
	rows   pgx.Rows      // a Query's rows, read by the generated code
	read   chan struct{} // closed when the generated code has closed rows
	queued chan struct{}
	done   chan struct{}
	err    error
}

func newDeferred() *deferred {
	return &deferred{queued: make(chan struct{}), done: make(chan struct{}), read: make(chan struct{})}
}

// QueryRow records the query; the returned row's Scan waits for the batch.
func (d *deferred) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	d.sql, d.args = sql, args
	return d
}

// Scan hands the destinations to the batch and waits for the result.
func (d *deferred) Scan(dest ...any) error {
	d.dest = dest
	close(d.queued)
	<-d.done
	return d.err
}

// Exec is not used by the queries a batch sends.
func (d *deferred) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errors.New("ratelimit: Exec in a batch")
}

// Query records the query and waits for the batch to reach it; the
// generated code then reads the rows from the batch, which waits until it
// has closed them.
func (d *deferred) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	d.sql, d.args, d.many = sql, args, true
	close(d.queued)
	<-d.done
	if d.err != nil {
		return nil, d.err
	}
	return &deferredRows{Rows: d.rows, read: d.read}, nil
}

// deferredRows tells the batch when the generated code is done with them.
type deferredRows struct {
	pgx.Rows
	read chan struct{}
	once sync.Once
}

// Close closes the rows and lets the batch go on to the next result.
func (r *deferredRows) Close() {
	r.Rows.Close()
	r.once.Do(func() { close(r.read) })
}

// runBatch sends b and delivers each result to its deferred query, in
// order. Every deferred query is released, with an error if need be.
func runBatch(ctx context.Context, db DB, b *pgx.Batch, stmts []*deferred) (err error) {
	release := func(from int, e error) {
		for _, s := range stmts[from:] {
			s.err = e
			close(s.done)
		}
	}
	bt, ok := db.(batcher)
	if !ok {
		e := fmt.Errorf("ratelimit: %T cannot send a batch; use a *pgxpool.Pool, *pgx.Conn or pgx.Tx", db)
		release(0, e)
		return e
	}
	br := bt.SendBatch(ctx, b)
	for i, s := range stmts {
		var e error
		if s.many {
			s.rows, s.err = br.Query()
			e = s.err
			close(s.done)
			if e == nil {
				<-s.read
				e = s.rows.Err()
			}
		} else {
			e = br.QueryRow().Scan(s.dest...)
			s.err = e
			close(s.done)
		}
		if e != nil {
			cerr := br.Close()
			if cerr == nil || pgerr.IsMultiDenied(e) {
				cerr = e
			}
			// Later statements never ran: the transaction is aborted.
			release(i+1, cerr)
			return e
		}
	}
	return br.Close()
}

// sameClock reports whether two limiters' statements run at one instant:
// both on the database's clock, or pinned to the same instant (tests).
func sameClock(a, b *Limiter) bool {
	ta, tb := a.at(), b.at()
	if ta == nil || tb == nil {
		return ta == nil && tb == nil
	}
	return ta.Equal(*tb)
}
