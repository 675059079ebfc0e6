package ratelimit

import (
	"bytes"
	"fmt"
	"slices"
	"time"
)

// ask is what one check asks for: n units, all of them or none, or with
// upTo as many of them as are left (a partial grant, AllowUpTo).
type ask struct {
	n    int64
	upTo bool
}

// retryCost is the cost whose admission RetryAfter waits for: the whole
// cost of an all-or-nothing check, one unit for a partial grant.
func (a ask) retryCost() int64 {
	if a.upTo {
		return 1
	}
	return a.n
}

// settle sets d.Granted for a decision no statement granted units in: an
// all-or-nothing check is granted its whole cost when allowed (by the
// store or the failure policy), and a partial grant that is allowed without
// a count (fail open) its whole ask (a.n is at most the capacity: see
// Config.ceiling). A shadow-mode denial reports what the limit granted,
// which is nothing: the check proceeds, but nothing was taken for it (a
// partial grant is denied only when nothing was left).
func (a ask) settle(d Decision) Decision {
	switch {
	case d.ShadowDenied:
		d.Granted = 0
	case !a.upTo && d.Allowed:
		d.Granted = a.n
	case !a.upTo:
		d.Granted = 0
	case d.Allowed && d.Store == StorePolicy:
		d.Granted = a.n
	}
	return d
}

// checkQueue is queues of checks, flattened as the …TakeQueue statements
// take them: rows (a limiter and a stored key) in key order, the order
// they are locked in; each row's checks in arrival order; ends[i] the
// 1-based position of row i's last check. at[j] is the position, in the
// caller's list, of the j-th check here.
type checkQueue struct {
	limiters []*Limiter // one per row: its limit and window go with it
	keys     [][]byte
	costs    []int64
	upTo     []bool
	ends     []int32
	at       []int
}

// newCheckQueue groups checks by row, each row's checks in their order.
func newCheckQueue(checks []*pendingCheck) *checkQueue {
	order := make([]int, len(checks))
	for i := range order {
		order[i] = i
	}
	// A stable sort keeps each row's checks in arrival order.
	slices.SortStableFunc(order, func(a, b int) int { return bytes.Compare(checks[a].skey, checks[b].skey) })
	q := &checkQueue{
		costs: make([]int64, len(order)),
		upTo:  make([]bool, len(order)),
		at:    order,
	}
	for j, i := range order {
		r := checks[i]
		if j == 0 || r.l != checks[order[j-1]].l || !bytes.Equal(r.skey, checks[order[j-1]].skey) {
			if j > 0 {
				q.ends = append(q.ends, int32(j))
			}
			q.limiters = append(q.limiters, r.l)
			q.keys = append(q.keys, r.skey)
		}
		// A partial grant asks for at most its row's capacity (a spread
		// row's is its share).
		q.costs[j], q.upTo[j] = r.l.cfg.ceiling(r.ask).n, r.ask.upTo
	}
	if len(order) > 0 {
		q.ends = append(q.ends, int32(len(order)))
	}
	return q
}

// ask is the j-th check of the queue.
func (q *checkQueue) ask(j int) ask { return ask{n: q.costs[j], upTo: q.upTo[j]} }

// limiterOf is the limiter of the j-th check.
func (q *checkQueue) limiterOf(j int) *Limiter {
	k, _ := slices.BinarySearch(q.ends, int32(j+1))
	return q.limiters[k]
}

// clock is the instant the statement runs at: the pinned clock of the
// queue's limiters (they share a statement only when theirs read the same
// instant, see statements), else nil, the database's.
func (q *checkQueue) clock() *time.Time { return q.limiters[0].at() }

// perRow returns f of each row's limiter.
func perRow[T any](q *checkQueue, f func(*Limiter) T) []T {
	out := make([]T, len(q.limiters))
	for i, l := range q.limiters {
		out[i] = f(l)
	}
	return out
}

// inCheckOrder gives each check of q the decision that decide makes from
// its row (index reads the row's 1-based check_index) with its limiter, in
// the caller's order. A statement must return exactly one row per check.
func inCheckOrder[R any](q *checkQueue, rows []R, err error, index func(R) int32, decide func(*Limiter, R, ask) Decision) ([]Decision, error) {
	if err != nil {
		return nil, err
	}
	if len(rows) != len(q.costs) {
		return nil, fmt.Errorf("ratelimit: queue statement returned %d rows for %d checks", len(rows), len(q.costs))
	}
	out := make([]Decision, len(q.costs))
	seen := make([]bool, len(q.costs))
	for _, row := range rows {
		j := int(index(row)) - 1
		if j < 0 || j >= len(q.costs) || seen[j] {
			return nil, fmt.Errorf("ratelimit: queue statement returned check %d of %d", j+1, len(q.costs))
		}
		seen[j] = true
		out[q.at[j]] = decide(q.limiterOf(j), row, q.ask(j))
	}
	return out, nil
}
