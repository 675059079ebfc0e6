package ratelimit

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"time"
)

// ask is what one check asks for: n units, all of them or none, or with
// upTo as many of them as are left (a partial grant, UpTo). A slice (Slice)
// is a partial grant sized by the statement: ceil(left/share), at least
// min, at most n.
type ask struct {
	n          int64
	upTo       bool
	slice      bool
	min, share int64
	id         []byte // the hash of RequestID's id, nil without one
	slot       []byte // an Acquire's slot token, nil for every other check
}

// retryCost is the cost whose admission RetryAfter waits for: the whole
// cost of an all-or-nothing check, one unit for a partial grant, min for a
// slice.
func (a ask) retryCost() int64 {
	switch {
	case a.slice:
		return a.min
	case a.upTo:
		return 1
	}
	return a.n
}

// own is the check a slice was asked for: min units, all or none. The
// failure policy answers a slice as that check: a slice is only ever
// counted in PostgreSQL.
func (a ask) own() ask {
	if a.slice {
		return ask{n: a.min}
	}
	return a
}

// settle sets d.Granted for a decision no statement granted units in: an
// all-or-nothing check is granted its whole cost when allowed (by the
// store or the failure policy), and a partial grant that is allowed without
// a count (fail open) its whole ask (a.n is at most the capacity: see
// Config.ceiling). A shadow-mode denial reports what the limit granted,
// which is nothing: the check proceeds, but nothing was taken for it (a
// partial grant is denied only when nothing was left).
func (a ask) settle(d Decision) Decision {
	if a.slice && d.Store != StorePostgres {
		a = a.own()
	}
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

// checkQueue is checks as the …TakeChecks statements take them: rows (a
// stored key and the limiter whose figures its checks count against), each
// key once, in ascending key order, the order they are locked in; and runs
// of checks, decided in order: a run of one row's checks (runs[g] is its
// 1-based row), each applied, or an all-or-nothing group (runs[g] is 0),
// allowed together or not at all; ends[g] is the 1-based position of run
// g's last check. Per check: its row, cost, partial-grant flag, and whether
// its denial stops its group (a limit in shadow mode does not). at[j] is
// the position, in the caller's list, of the j-th check here.
type checkQueue struct {
	limiters []*Limiter // one per row: its limit and window go with it
	keys     [][]byte
	runs     []int32
	ends     []int32
	rows     []int32
	costs    []int64
	upTo     []bool
	vetoes   []bool
	mins     []int64 // a slice's min, 0 for any other check
	shares   []int64 // a slice's share, 0 for any other check
	at       []int
	// request is the request id of the queue's one check, or nil: the
	// statement stores its answer, or returns the one stored (RequestID).
	request *requestRef
	// policies is nil unless a row's checks read their figures from a
	// stored policy (pendingCheck.policy): then per row, that policy's
	// name (empty for a row counted at its limiter's figures), the key as
	// the policy's overrides store it, and the key mode the policy must
	// have, for the …TakePolicyChecks statements.
	policies     []string
	overrideKeys [][]byte
	keyModes     []string
}

// errPolicyMismatch: a …TakePolicyChecks statement found a row's stored
// policy changed under its limiter, and decided nothing (no check was
// counted). The coalescer then decides each check on its own.
var errPolicyMismatch = errors.New("ratelimit: a stored policy no longer matches its limiter; nothing was counted")

// lone reports whether q is one check that asks for its whole cost: no
// partial grant, no slice.
func (q *checkQueue) lone() bool {
	return len(q.costs) == 1 && !q.upTo[0] && q.shares[0] == 0
}

// takeOrReplay makes a lone check with a request id (checkQueue.lone) with
// take, its …TakeOnce statement, which counts nothing and returns no row
// when the id is stored already: answer then reads the stored answer. An
// answer deleted in between (by rl-cleanup, past its retention) has freed
// the id, and the check is made again.
func takeOrReplay[T any](take, answer func() ([]T, error)) (rows []T, replayed bool, err error) {
	for range 2 {
		if rows, err = take(); err != nil || len(rows) > 0 {
			return rows, false, err
		}
		if rows, err = answer(); err != nil || len(rows) > 0 {
			return rows, true, err
		}
	}
	return nil, false, nil
}

// rowsAs is rows of one statement as the rows of another with the same
// columns.
func rowsAs[T, R any](rows []R, as func(R) T) []T {
	out := make([]T, len(rows))
	for i, r := range rows {
		out[i] = as(r)
	}
	return out
}

// requestRef is where a check with a request id stores its answer: under
// the counter row's stored key and the id's hash, kept retainUs.
type requestRef struct {
	key, id  []byte
	retainUs int64
}

// figures are what a row's checks count against: two limiters whose
// figures are equal may share a row.
type figures struct {
	limit, windowUs, burst int64
	penalty                bool
	policy                 string // the stored policy the row reads, if any
}

func (l *Limiter) figures() figures {
	return figures{limit: l.cfg.Limit, windowUs: l.windowUs, burst: l.cfg.Burst, penalty: l.cfg.Penalty}
}

// newCheckQueue makes the statement of checks: lone checks (group 0) and
// all-or-nothing groups (consecutive checks of one group number, each of
// another key). A key's checks must all have one limiter's figures (see
// statements). Each key's checks are decided in their order, and each
// group where it stands among them: between two groups, the lone checks
// are gathered by key into runs, which the statement decides with one read
// and one write of the row's state, as a queue of checks.
func newCheckQueue(checks []*pendingCheck) *checkQueue {
	n := len(checks)
	q := &checkQueue{rows: make([]int32, n), costs: make([]int64, n), upTo: make([]bool, n), vetoes: make([]bool, n),
		mins: make([]int64, n), shares: make([]int64, n), at: make([]int, 0, n)}
	byKey := make(map[string]int32, n)
	for _, r := range checks {
		if _, ok := byKey[string(r.skey)]; !ok {
			byKey[string(r.skey)] = 0
			q.keys = append(q.keys, r.skey)
			q.limiters = append(q.limiters, r.l)
		}
	}
	order := make([]int, len(q.keys))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return bytes.Compare(q.keys[a], q.keys[b]) })
	keys, limiters := make([][]byte, len(order)), make([]*Limiter, len(order))
	for row, i := range order {
		keys[row], limiters[row] = q.keys[i], q.limiters[i]
		byKey[string(keys[row])] = int32(row + 1)
	}
	q.keys, q.limiters = keys, limiters
	// lone gathers the lone checks since the last group, by row.
	var lone []int
	flush := func() {
		slices.SortStableFunc(lone, func(a, b int) int {
			return int(byKey[string(checks[a].skey)] - byKey[string(checks[b].skey)])
		})
		for k, i := range lone {
			row := byKey[string(checks[i].skey)]
			if k == 0 || row != byKey[string(checks[lone[k-1]].skey)] {
				q.runs = append(q.runs, row)
				q.ends = append(q.ends, 0)
			}
			q.at = append(q.at, i)
			q.ends[len(q.ends)-1] = int32(len(q.at))
		}
		lone = lone[:0]
	}
	for i := 0; i < n; {
		if checks[i].group == 0 {
			lone = append(lone, i)
			i++
			continue
		}
		flush()
		for g := checks[i].group; i < n && checks[i].group == g; i++ {
			q.at = append(q.at, i)
		}
		q.runs = append(q.runs, 0)
		q.ends = append(q.ends, int32(len(q.at)))
	}
	flush()
	for j, i := range q.at {
		r := checks[i]
		q.rows[j] = byKey[string(r.skey)]
		if r.policy && q.policies == nil {
			q.policies = make([]string, len(q.keys))
			q.overrideKeys = make([][]byte, len(q.keys))
			q.keyModes = make([]string, len(q.keys))
		}
		if row := q.rows[j] - 1; r.policy {
			q.policies[row] = r.l.cfg.Policy
			q.overrideKeys[row] = r.l.policyKey(r.key, r.skey)
			q.keyModes[row] = keyModeText(r.l.cfg.KeyMode)
		}
		// A partial grant asks for at most its row's capacity (a spread
		// row's is its share).
		q.costs[j], q.upTo[j], q.vetoes[j] = r.l.cfg.ceiling(r.ask).n, r.ask.upTo, !r.l.cfg.Shadow
		if r.ask.slice {
			q.mins[j], q.shares[j] = r.ask.min, r.ask.share
		}
	}
	return q
}

// ask is the j-th check of the queue.
func (q *checkQueue) ask(j int) ask {
	return ask{n: q.costs[j], upTo: q.upTo[j], slice: q.shares[j] > 0, min: q.mins[j], share: q.shares[j]}
}

// limiterOf is the limiter of the j-th check.
func (q *checkQueue) limiterOf(j int) *Limiter { return q.limiters[q.rows[j]-1] }

// clock is the instant the statement runs at: the pinned clock of the
// queue's limiters' Database (DatabaseOptions.Now; checks share a
// statement only when they read the same instant, see statements), else
// nil, the database's.
func (q *checkQueue) clock() *time.Time { return q.limiters[0].at() }

// markReplayed sets Decision.Replayed on decs when the statement returned
// a stored answer (RequestID).
func markReplayed(decs []Decision, replayed bool) {
	for i := range decs {
		decs[i].Replayed = replayed
	}
}

// perRow returns f of each row's limiter.
func perRow[T any](q *checkQueue, f func(*Limiter) T) []T {
	out := make([]T, len(q.limiters))
	for i, l := range q.limiters {
		out[i] = f(l)
	}
	return out
}

// limits is each row's limit (the window algorithms' max_counts).
func (q *checkQueue) limits() []int64 {
	return perRow(q, func(l *Limiter) int64 { return l.cfg.Limit })
}

// windowsUs is each row's window in microseconds.
func (q *checkQueue) windowsUs() []int64 {
	return perRow(q, func(l *Limiter) int64 { return l.windowUs })
}

// penalties is each row's Penalty.
func (q *checkQueue) penalties() []bool {
	return perRow(q, func(l *Limiter) bool { return l.cfg.Penalty })
}

// capacities is each row's bucket capacity (Burst).
func (q *checkQueue) capacities() []float64 {
	return perRow(q, func(l *Limiter) float64 { return float64(l.cfg.Burst) })
}

// refillsPerUs is each row's refill in tokens per microsecond.
func (q *checkQueue) refillsPerUs() []float64 {
	return perRow(q, func(l *Limiter) float64 { return l.refillPerUs })
}

// inCheckOrder gives each check of q the decision that decide makes from
// its row (index reads the row's 1-based check_index) with its limiter, in
// the caller's order. A statement must return exactly one row per check.
func inCheckOrder[R any](q *checkQueue, rows []R, err error, index func(R) int32, decide func(*Limiter, R, ask) Decision) ([]Decision, error) {
	if err == nil && len(rows) != len(q.costs) {
		return nil, fmt.Errorf("ratelimit: check statement returned %d rows for %d checks", len(rows), len(q.costs))
	}
	out, _, err := someInCheckOrder(q, rows, err, index, decide)
	return out, err
}

// someInCheckOrder is inCheckOrder for a statement that may leave checks
// undecided (the run statements): decided[i] reports whether the caller's
// i-th check came back.
func someInCheckOrder[R any](q *checkQueue, rows []R, err error, index func(R) int32, decide func(*Limiter, R, ask) Decision) (out []Decision, decided []bool, _ error) {
	if err != nil {
		return nil, nil, err
	}
	out = make([]Decision, len(q.costs))
	decided = make([]bool, len(q.costs))
	for _, row := range rows {
		j := int(index(row)) - 1
		if j < 0 || j >= len(q.costs) || decided[q.at[j]] {
			return nil, nil, fmt.Errorf("ratelimit: check statement returned check %d of %d", j+1, len(q.costs))
		}
		decided[q.at[j]] = true
		out[q.at[j]] = decide(q.limiterOf(j), row, q.ask(j))
	}
	return out, decided, nil
}

// plainRuns reports whether q's checks are what the run statements
// (…TakeRuns) decide: lone checks of one unit each, all or nothing, of
// limiters without Penalty, with no request id and no stored policy.
func (q *checkQueue) plainRuns() bool {
	if q.request != nil || q.policies != nil || len(q.runs) != len(q.keys) {
		return false
	}
	for _, r := range q.runs {
		if r == 0 {
			return false
		}
	}
	for j, n := range q.costs {
		if n != 1 || q.upTo[j] || q.shares[j] != 0 {
			return false
		}
	}
	for _, l := range q.limiters {
		if l.cfg.Penalty {
			return false
		}
	}
	return true
}
