package ratelimit

import (
	"bytes"
	"fmt"
	"slices"
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
// store, the failure policy or shadow mode), and a partial grant that is
// allowed without a count (fail open, shadow mode) its whole cost too.
func (a ask) settle(d Decision) Decision {
	switch {
	case !a.upTo && d.Allowed:
		d.Granted = a.n
	case !a.upTo:
		d.Granted = 0
	case d.Allowed && (d.ShadowDenied || d.Store == StorePolicy):
		d.Granted = a.n
	}
	return d
}

// checkQueue is queues of checks on distinct keys, flattened as the
// …TakeQueue statements take them: keys sorted (the order their rows are
// locked), each key's checks in arrival order, ends[i] the 1-based position
// of key i's last check. at[j] is the position, in the caller's list, of
// the j-th check here.
type checkQueue struct {
	keys  [][]byte
	costs []int64
	upTo  []bool
	ends  []int32
	at    []int
}

// newCheckQueue groups checks by key: keys[i] asks asks[i]. Checks of one key
// keep their order.
func newCheckQueue(keys [][]byte, asks []ask) *checkQueue {
	order := make([]int, len(keys))
	for i := range order {
		order[i] = i
	}
	// A stable sort keeps each key's checks in arrival order.
	slices.SortStableFunc(order, func(a, b int) int { return bytes.Compare(keys[a], keys[b]) })
	q := &checkQueue{
		costs: make([]int64, len(order)),
		upTo:  make([]bool, len(order)),
		at:    order,
	}
	for j, i := range order {
		if j > 0 && !bytes.Equal(keys[i], keys[order[j-1]]) {
			q.ends = append(q.ends, int32(j))
		}
		if j == 0 || !bytes.Equal(keys[i], keys[order[j-1]]) {
			q.keys = append(q.keys, keys[i])
		}
		q.costs[j], q.upTo[j] = asks[i].n, asks[i].upTo
	}
	if len(order) > 0 {
		q.ends = append(q.ends, int32(len(order)))
	}
	return q
}

// ask is the j-th check of the queue.
func (q *checkQueue) ask(j int) ask { return ask{n: q.costs[j], upTo: q.upTo[j]} }

// inCheckOrder gives each check of q the decision that decide makes from
// its row (index reads the row's 1-based check_index), in the caller's
// order. A statement must return exactly one row per check.
func inCheckOrder[R any](q *checkQueue, rows []R, err error, index func(R) int32, decide func(R, ask) Decision) ([]Decision, error) {
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
		out[q.at[j]] = decide(row, q.ask(j))
	}
	return out, nil
}
