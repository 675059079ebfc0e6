package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// The engine stage of a check (see decide in pipeline.go): the statements
// that ask PostgreSQL, within DatabaseOptions.Timeout, coalesced with other callers'
// checks (coalesce.go, queue.go) or in the caller's transaction, and the
// partitions created when a window has none.

// allowWithin asks PostgreSQL, answering by DatabaseOptions.Timeout at the latest,
// whatever the caller's context. The statement runs on the caller's
// goroutine under a context that ends at the Timeout: pgx stops at a
// context's deadline (it sets the connection's deadline, and waiting for a
// pooled connection or for a coalesced batch ends with the context too), so
// handing each check to a goroutine of its own, which cost 30 to 45 µs per
// check at one caller (docs/BENCHMARKS.md), buys nothing;
// TestStallDefaultConfigBounded holds it to the bound against a server that
// stops answering.
func (l *Limiter) allowWithin(ctx context.Context, key string, a ask) (Decision, error) {
	cctx, cancel := l.st.deadlines.within(ctx, l.st.opts.Timeout)
	defer cancel()
	d, err := l.allowDB(cctx, key, a)
	if err != nil && cctx.Err() != nil {
		// Report the deadline, with what the statement's error says of
		// its outcome: it may still reach the database and count.
		return Decision{}, carryOutcome(err, cctx.Err(), false)
	}
	return d, err
}

// allowDB asks PostgreSQL, and with DatabaseOptions.CreatePartitions creates a
// missing partition and asks once more. A spread
// limit's caller passes the row that decides (see Limiter.validate).
func (l *Limiter) allowDB(ctx context.Context, key string, a ask) (Decision, error) {
	take := func() (Decision, error) {
		if l.coalescer != nil && a.id == nil {
			return l.coalescer.take(ctx, l, key, a)
		}
		return l.take(ctx, l.st.db, key, a)
	}
	d, err := take()
	if err != nil && l.st.opts.CreatePartitions && l.alg.partitioned() && isMissingPartition(err) {
		// Partitioned layout and nobody created this window's partition
		// yet (cleanup creates them ahead; it may not have run). Create it
		// and check again.
		if herr := l.heal(ctx, l.st.db); herr != nil {
			// The check's statement failed whole: it counted nothing.
			return Decision{}, WithOutcome(herr, OutcomeNotConsumed)
		}
		d, err = take()
	}
	return d, err
}

// takeInTx is one check of l (a spread limit's row) in the caller's
// transaction. A missing partition is created outside it, and the caller
// is asked to retry: the failed statement aborted the transaction.
func (l *Limiter) takeInTx(ctx context.Context, tx pgx.Tx, key string, a ask) (Decision, error) {
	d, err := l.take(ctx, tx, key, a)
	if err != nil && l.st.opts.CreatePartitions && l.alg.partitioned() && isMissingPartition(err) {
		if herr := l.heal(ctx, l.st.db); herr != nil {
			return Decision{}, mapErr(herr)
		}
		return Decision{}, fmt.Errorf("%w: %w", ErrPartitionMissing, err)
	}
	return d, err
}

func (l *Limiter) take(ctx context.Context, db DB, key string, a ask) (Decision, error) {
	if l.shards != nil {
		d, err := l.pickShard(a.retryCost()).take(ctx, db, key, a)
		return l.spreadDecision(d), err
	}
	return l.takeStored(ctx, db, key, l.key(key), a)
}

// takeStored is take for key, whose stored form is k: at the stored
// policy, read in the statement, for a limiter that has one (Config.Policy)
// and a check that asks for its whole cost.
//
// While the policy holds the limiter's own figures, a check of a key that
// had no override when the limiter last read the policy's override keys
// (or of any key, while the policy has no override at all) sends
// takeUnderPolicy, which reads the policy's row alone. When that counts
// nothing (the policy's figures or its overrides' keys changed), the check
// sends takePolicy, which reads the key's override too, and then reads the
// keys again (rereadPolicyKeys). A key with an override always sends
// takePolicy.
func (l *Limiter) takeStored(ctx context.Context, db DB, key string, k []byte, a ask) (Decision, error) {
	if l.cfg.Policy == "" || a.upTo {
		return l.takeKey(ctx, db, k, a)
	}
	okey, revision, seen, lean := l.leanPolicy(key, k)
	if lean {
		d, err := l.alg.takeUnderPolicy(ctx, l, db, k, a.n, revision)
		if !errors.Is(err, pgx.ErrNoRows) {
			return d, err
		}
	}
	if okey == nil {
		okey = l.policyKey(key, k)
	}
	d, err := l.alg.takePolicy(ctx, l, db, k, okey, a.n)
	if !lean {
		return d, err
	}
	if err == nil {
		if rdb, ok := l.rereadOn(db); ok {
			l.rereadPolicyKeys(ctx, rdb, seen)
		}
	}
	return d, err
}

// rereadOn is where a check sent on db reads its policy's override keys
// again: db itself, unless db is the caller's transaction (a …Tx check),
// whose snapshot may be old and which a failed read would abort without
// the caller knowing; then the Database's pool, or nowhere when the
// Database has a single connection (a later check reads them).
func (l *Limiter) rereadOn(db DB) (DB, bool) {
	if db == l.st.db {
		return db, true
	}
	if singleConn(l.st.db) {
		return nil, false
	}
	return l.st.db, true
}

// policyKey is key as pgrl_policy_override stores it: under the policy's
// name, which is k (the counter's stored key) when the counters are stored
// under that name too.
func (l *Limiter) policyKey(key string, k []byte) []byte {
	if l.cfg.Policy == l.counterName() {
		return k
	}
	return StoredKey(l.cfg.KeyMode, l.cfg.Policy, key)
}

// takeSlice decides a slice (Slice) of the stored key k on its own: a check
// statement of one check, the statements that decide slices (migrations
// 000015 and 000016). Concurrent slices go through the coalescer instead,
// with other checks.
func (l *Limiter) takeSlice(ctx context.Context, db DB, k []byte, a ask) (Decision, error) {
	decs, err := l.alg.takeQueue(ctx, db, newCheckQueue([]*pendingCheck{{l: l, skey: k, ask: a}}))
	if err != nil {
		return Decision{}, err
	}
	return decs[0], nil
}

// takeOnce decides a check with a request id (RequestID) of the stored key
// k: a check statement of one check that stores its answer under the id,
// or returns the answer stored (Decision.Replayed). A check of the same id
// at once made the statement fail with unique_violation, counting nothing:
// it is sent again, and finds that check's answer. Not in the caller's
// transaction, which the failure aborted: its error is returned.
func (l *Limiter) takeOnce(ctx context.Context, db DB, k []byte, a ask) (Decision, error) {
	q := newCheckQueue([]*pendingCheck{{l: l, skey: k, ask: a}})
	q.request = &requestRef{key: k, id: a.id, retainUs: l.windowUs}
	decs, err := l.alg.takeQueue(ctx, db, q)
	if _, inTx := db.(pgx.Tx); err != nil && !inTx && pgerr.IsRequestRace(err) {
		decs, err = l.alg.takeQueue(ctx, db, q)
	}
	if err != nil {
		return Decision{}, err
	}
	return decs[0], nil
}

// takeKey is take for a key already in its stored form.
func (l *Limiter) takeKey(ctx context.Context, db DB, k []byte, a ask) (Decision, error) {
	if a.slot != nil {
		return l.acquireSlot(ctx, db, k, a.slot)
	}
	if a.id != nil {
		return l.takeOnce(ctx, db, k, a)
	}
	if a.slice {
		return l.takeSlice(ctx, db, k, a)
	}
	if a.upTo {
		// l may be one row of a spread limit, whose capacity is its share.
		return l.alg.takeUpTo(ctx, l, db, k, l.cfg.ceiling(a).n)
	}
	return l.alg.take(ctx, l, db, k, a.n)
}

func (l *Limiter) heal(ctx context.Context, db DB) error {
	_, err := sqlops.New().FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{
		AtUs: l.atUs(), WindowUs: l.windowUs,
	})
	return err
}

// isMissingPartition reports a row that no partition accepts.
func isMissingPartition(err error) bool {
	kind, _ := pgerr.Classify(err)
	return kind == pgerr.NoPartition
}

// decideMultiWithin decides group by the Timeout of its first limiter (in
// the caller's transaction, by the caller's context), creating missing
// partitions and deciding again when every partitioned limiter of the
// group may create them.
func decideMultiWithin(ctx context.Context, tx pgx.Tx, mode MultiMode, group []*pendingCheck) ([]Decision, error) {
	first := group[0].l
	cctx := ctx
	if tx == nil {
		var cancel context.CancelFunc
		cctx, cancel = first.st.deadlines.within(ctx, first.st.opts.Timeout)
		defer cancel()
	}
	take := func() ([]Decision, error) {
		if tx == nil && oneStatement(group) {
			return takeGroup(cctx, mode, group)
		}
		return takeInTx(cctx, tx, mode, group)
	}
	decs, err := take()
	if err != nil && isMissingPartition(err) && !slices.ContainsFunc(group, func(r *pendingCheck) bool {
		return r.l.alg.partitioned() && !r.l.st.opts.CreatePartitions
	}) {
		// Outside the caller's transaction, if any.
		healed := map[int64]bool{}
		for _, r := range group {
			if r.l.alg.partitioned() && !healed[r.l.windowUs] {
				healed[r.l.windowUs] = true
				if herr := r.l.heal(cctx, r.l.st.db); herr != nil {
					// The decision's statement failed whole.
					return nil, WithOutcome(herr, OutcomeNotConsumed)
				}
			}
		}
		decs, err = take()
	}
	if err != nil && cctx.Err() != nil && tx == nil {
		return nil, carryOutcome(err, cctx.Err(), false)
	}
	for i := range decs {
		decs[i].Store = StorePostgres
	}
	return decs, err
}

// oneStatement reports whether one check statement decides group: one
// algorithm, one clock.
func oneStatement(group []*pendingCheck) bool {
	first := group[0].l
	for _, r := range group {
		if r.l.alg != first.alg || !sameClock(r.l, first) {
			return false
		}
	}
	return true
}

// takeGroup decides group in one check statement, under AllOrNothing as
// one group (applied only when all allow): through the coalescer its
// limiters share, where it rides the statement of other callers' checks,
// or else on its own.
func takeGroup(ctx context.Context, mode MultiMode, group []*pendingCheck) ([]Decision, error) {
	first := group[0].l
	c := first.coalescer
	for _, r := range group {
		if mode == AllOrNothing {
			r.group = 1
		}
		if r.l.coalescer != c {
			c = nil
		}
	}
	if c == nil {
		return first.alg.takeQueue(ctx, first.st.db, newCheckQueue(group))
	}
	if err := c.takeGroup(ctx, group); err != nil {
		return nil, err
	}
	decs := make([]Decision, len(group))
	for i, r := range group {
		if r.err != nil {
			return nil, r.err
		}
		decs[i] = r.d
	}
	return decs, nil
}

// takeInTx decides group in a transaction: a savepoint of tx, or one begun
// on the limiters' database; one check statement per algorithm (per clock),
// tables in one fixed order (fixed window, token bucket, sliding window),
// keys in byte order within each, so that concurrent decisions over
// overlapping keys never deadlock. Under AllOrNothing the transaction is
// rolled back when a check with a veto (not in shadow mode) denied, so
// nothing is consumed; every check is decided either way.
func takeInTx(ctx context.Context, tx pgx.Tx, mode MultiMode, group []*pendingCheck) ([]Decision, error) {
	var sp pgx.Tx
	var err error
	if tx != nil {
		sp, err = tx.Begin(ctx)
	} else {
		sp, err = begin(ctx, group[0].l.st.db)
		if err != nil {
			err = mark(err, uncommitted)
		}
	}
	if err != nil {
		return nil, err
	}
	defer func() { _ = sp.Rollback(context.WithoutCancel(ctx)) }() // after Commit, a no-op
	order := make([]int, len(group))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return group[a].l.alg.lockRank() - group[b].l.alg.lockRank() })
	decs := make([]Decision, len(group))
	denied := false
	for k := 0; k < len(order); {
		end := k + 1
		for end < len(order) && group[order[end]].l.alg == group[order[k]].l.alg &&
			sameClock(group[order[end]].l, group[order[k]].l) {
			end++
		}
		span := make([]*pendingCheck, end-k)
		for i, j := range order[k:end] {
			span[i] = group[j]
		}
		got, err := span[0].l.alg.takeQueue(ctx, sp, newCheckQueue(span))
		if err != nil {
			if tx == nil {
				// Before the COMMIT: the server rolls the transaction back.
				err = mark(err, uncommitted)
			}
			return nil, err
		}
		for i, j := range order[k:end] {
			decs[j] = got[i]
			denied = denied || !got[i].Allowed && !group[j].l.cfg.Shadow
		}
		k = end
	}
	if denied && mode == AllOrNothing {
		if err := sp.Rollback(ctx); err != nil {
			if tx == nil {
				// Never committed, whatever became of the connection.
				err = mark(err, uncommitted)
			}
			return nil, err
		}
		return decs, nil
	}
	return decs, sp.Commit(ctx)
}

// begin begins a transaction on db, which must be able to (a pool or a
// connection, or a DB of your own wrapping one).
func begin(ctx context.Context, db DB) (pgx.Tx, error) {
	b, ok := db.(interface {
		Begin(context.Context) (pgx.Tx, error)
	})
	if !ok {
		return nil, invalid(ErrUnsupported, "a decision over limits of several algorithms runs in a transaction, and %T cannot begin one: pass a *pgxpool.Pool or a *pgx.Conn, or use AllowAllTx", db)
	}
	return b.Begin(ctx)
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
