package ratelimit

import (
	"context"
	"math"
	"math/bits"
	"time"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// slidingWindow estimates the units of the Window that ends now from the
// current and the previous aligned window, the previous one weighted by how
// much of it the sliding window still covers.
type slidingWindow struct{}

func (slidingWindow) validate(Config) error              { return nil }
func (slidingWindow) capacity(c Config) int64            { return c.Limit }
func (slidingWindow) fallbackConfig(_, fb Config) Config { return fb }
func (slidingWindow) spreadRow(row Config) Config        { return row }
func (slidingWindow) table() string                      { return "pgrl_sliding_window" }
func (slidingWindow) partitioned() bool                  { return false }
func (slidingWindow) lockRank() int                      { return 2 }

func (slidingWindow) take(ctx context.Context, l *Limiter, db DB, k []byte, cost int64) (Decision, error) {
	r, err := l.q.SlidingWindowTake(ctx, db, gen.SlidingWindowTakeParams{
		Key: k, At: l.at(), WindowUs: l.windowUs, Cost: cost, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs), cost), nil
}

func (slidingWindow) takePolicy(ctx context.Context, l *Limiter, db DB, k, ok []byte, cost int64) (Decision, error) {
	r, err := sqlops.New().SlidingWindowTakePolicy(ctx, db, sqlops.SlidingWindowTakePolicyParams{
		Key: k, Cost: cost, At: l.at(), WindowUs: l.windowUs,
		Policy: l.cfg.Policy, OverrideKey: ok, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	if err != nil {
		return Decision{}, l.policyErr(err)
	}
	s := l.applied(Rate{Limit: r.MaxCount, Window: l.cfg.Window})
	return s.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs), cost), nil
}

func (slidingWindow) takeUnderPolicy(ctx context.Context, l *Limiter, db DB, k []byte, cost, revision int64) (Decision, error) {
	r, err := sqlops.New().SlidingWindowTakeUnderPolicy(ctx, db, sqlops.SlidingWindowTakeUnderPolicyParams{
		Key: k, Cost: cost, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
		Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode), OverridesRevision: revision,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs), cost), nil
}

func (slidingWindow) takeMany(ctx context.Context, l *Limiter, db DB, keys [][]byte, costs []int64) ([]Decision, error) {
	rows, err := sqlops.New().SlidingWindowTakeMany(ctx, db, sqlops.SlidingWindowTakeManyParams{
		Keys: keys, Costs: costs, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	return inKeyOrder(keys, rows, err, func(row sqlops.SlidingWindowTakeManyRow) string { return row.KeyHex },
		func(row sqlops.SlidingWindowTakeManyRow, i int) Decision {
			return l.slidingDecision(row.Allowed, usTime(row.WindowStartUs), row.Count, row.PrevCount, usTime(row.NowUs), costs[i])
		})
}

func (slidingWindow) takeManyPolicy(ctx context.Context, l *Limiter, db DB, keys, okeys [][]byte, costs []int64) ([]Decision, []bool, error) {
	rows, err := sqlops.New().SlidingWindowTakeManyPolicy(ctx, db, sqlops.SlidingWindowTakeManyPolicyParams{
		Keys: keys, OverrideKeys: okeys, Costs: costs, At: l.at(), WindowUs: l.windowUs,
		Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	return someInKeyOrder(keys, rows, err, func(row sqlops.SlidingWindowTakeManyPolicyRow) string { return row.KeyHex },
		func(row sqlops.SlidingWindowTakeManyPolicyRow, i int) Decision {
			s := l.applied(Rate{Limit: row.MaxCount, Window: l.cfg.Window})
			return s.slidingDecision(row.Allowed, usTime(row.WindowStartUs), row.Count, row.PrevCount, usTime(row.NowUs), costs[i])
		})
}

func (slidingWindow) takeUpTo(ctx context.Context, l *Limiter, db DB, k []byte, n int64) (Decision, error) {
	r, err := l.q.SlidingWindowTakeUpTo(ctx, db, gen.SlidingWindowTakeUpToParams{
		Key: k, N: n, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs), 1).granting(r.Granted), nil
}

func (slidingWindow) takeQueue(ctx context.Context, db DB, q *checkQueue) ([]Decision, error) {
	p := sqlops.SlidingWindowTakeChecksParams{
		Keys:      q.keys,
		MaxCounts: q.limits(),
		WindowsUs: q.windowsUs(),
		Penalties: q.penalties(),
		Runs:      q.runs, Ends: q.ends, Rows: q.rows, Costs: q.costs, UpTo: q.upTo, Vetoes: q.vetoes,
		Mins: q.mins, Shares: q.shares, At: q.clock(),
	}
	if q.policies != nil {
		return slidingWindow{}.takePolicyQueue(ctx, db, q, p)
	}
	var rows []sqlops.SlidingWindowTakeChecksRow
	var err error
	replayed := false
	if r := q.request; r == nil {
		rows, err = sqlops.New().SlidingWindowTakeChecks(ctx, db, p)
	} else if q.lone() {
		rows, replayed, err = takeOrReplay(func() ([]sqlops.SlidingWindowTakeChecksRow, error) {
			once, err := sqlops.New().SlidingWindowTakeOnce(ctx, db, sqlops.SlidingWindowTakeOnceParams{
				RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs, Key: p.Keys[0], At: p.At,
				WindowUs: p.WindowsUs[0], Cost: p.Costs[0], MaxCount: p.MaxCounts[0], Penalty: p.Penalties[0],
			})
			return rowsAs(once, func(o sqlops.SlidingWindowTakeOnceRow) sqlops.SlidingWindowTakeChecksRow {
				return sqlops.SlidingWindowTakeChecksRow(o)
			}), err
		}, func() ([]sqlops.SlidingWindowTakeChecksRow, error) {
			stored, err := sqlops.New().SlidingWindowAnswer(ctx, db, sqlops.SlidingWindowAnswerParams{
				RequestKey: r.key, RequestID: r.id,
			})
			return rowsAs(stored, func(o sqlops.SlidingWindowAnswerRow) sqlops.SlidingWindowTakeChecksRow {
				return sqlops.SlidingWindowTakeChecksRow(o)
			}), err
		})
	} else {
		var once []sqlops.SlidingWindowTakeChecksOnceRow
		once, err = sqlops.New().SlidingWindowTakeChecksOnce(ctx, db, sqlops.SlidingWindowTakeChecksOnceParams{
			RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs,
			Keys: p.Keys, MaxCounts: p.MaxCounts, WindowsUs: p.WindowsUs, Penalties: p.Penalties, Runs: p.Runs,
			Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes, Mins: p.Mins,
			Shares: p.Shares, At: p.At,
		})
		for _, o := range once {
			rows = append(rows, sqlops.SlidingWindowTakeChecksRow{CheckIndex: o.CheckIndex, Granted: o.Granted,
				WindowStartUs: o.WindowStartUs, Count: o.Count, PrevCount: o.PrevCount, Allowed: o.Allowed,
				NowUs: o.NowUs})
			replayed = replayed || o.Replayed
		}
	}
	decs, err := inCheckOrder(q, rows, err, slidingCheckIndex, slidingChecked)
	markReplayed(decs, replayed)
	return decs, err
}

func slidingCheckIndex(r sqlops.SlidingWindowTakeChecksRow) int32 { return r.CheckIndex }

// slidingChecked is the decision of a check statement's row.
func slidingChecked(l *Limiter, r sqlops.SlidingWindowTakeChecksRow, a ask) Decision {
	return l.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs),
		a.retryCost()).granting(r.Granted)
}

func (slidingWindow) takeRuns(ctx context.Context, db DB, q *checkQueue) ([]Decision, []bool, error) {
	rows, err := sqlops.New().SlidingWindowTakeRuns(ctx, db, sqlops.SlidingWindowTakeRunsParams{
		Keys:      q.keys,
		Rows:      q.rows,
		Ends:      q.ends,
		MaxCounts: q.limits(),
		WindowsUs: q.windowsUs(),
		At:        q.clock(),
	})
	return someInCheckOrder(q, rowsAs(rows, func(r sqlops.SlidingWindowTakeRunsRow) sqlops.SlidingWindowTakeChecksRow {
		return sqlops.SlidingWindowTakeChecksRow(r)
	}), err, slidingCheckIndex, slidingChecked)
}

// takePolicyQueue is takeQueue for a queue with rows that read their
// stored policy (checkQueue.policies): each check is decided at the limit
// its row read.
func (slidingWindow) takePolicyQueue(ctx context.Context, db DB, q *checkQueue, p sqlops.SlidingWindowTakeChecksParams) ([]Decision, error) {
	rows, err := sqlops.New().SlidingWindowTakePolicyChecks(ctx, db, sqlops.SlidingWindowTakePolicyChecksParams{
		Keys: p.Keys, MaxCounts: p.MaxCounts, WindowsUs: p.WindowsUs, Penalties: p.Penalties, Runs: p.Runs,
		Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes, Mins: p.Mins, Shares: p.Shares,
		At: p.At, Policies: q.policies, OverrideKeys: q.overrideKeys, KeyModes: q.keyModes,
	})
	if err == nil && len(rows) == 0 && len(q.costs) > 0 {
		return nil, errPolicyMismatch
	}
	return inCheckOrder(q, rows, err, func(r sqlops.SlidingWindowTakePolicyChecksRow) int32 { return r.CheckIndex },
		func(l *Limiter, r sqlops.SlidingWindowTakePolicyChecksRow, a ask) Decision {
			s := l.applied(Rate{Limit: r.MaxCount, Window: l.cfg.Window})
			return s.slidingDecision(r.Allowed, usTime(r.WindowStartUs), r.Count, r.PrevCount, usTime(r.NowUs),
				a.retryCost()).granting(r.Granted)
		})
}

// refund takes n units off the window r counted them in: from the row's
// count while the row is in that window, from its previous count once it
// has moved one window on, never below zero; none once it has moved two
// (sqlops.SlidingWindowReturnSlice).
func (slidingWindow) refund(ctx context.Context, l *Limiter, db DB, k []byte, r reservation, n int64) (int64, error) {
	rows, err := sqlops.New().SlidingWindowReturnSlice(ctx, db, sqlops.SlidingWindowReturnSliceParams{
		Key: k, N: n, WindowStartUs: r.WindowStartUs, WindowUs: l.windowUs,
	})
	if err != nil || rows == 0 {
		return 0, err
	}
	return n, nil
}

func (slidingWindow) peek(ctx context.Context, l *Limiter, db DB, k []byte) (Decision, error) {
	r, err := l.q.SlidingWindowPeek(ctx, db, gen.SlidingWindowPeekParams{
		Key: k, At: l.at(), WindowUs: l.windowUs,
	})
	if err != nil {
		return Decision{}, err
	}
	start, now := usTime(r.WindowStartUs), usTime(r.NowUs)
	allowed := slidingFits(r.PrevCount, r.Count, 1, l.elapsedUs(start, now), l.windowUs, l.cfg.Limit)
	return l.slidingDecision(allowed, start, r.Count, r.PrevCount, now, 1), nil
}

func (slidingWindow) reset(ctx context.Context, l *Limiter, db DB, k []byte) error {
	_, err := l.q.SlidingWindowReset(ctx, db, k)
	return err
}

// elapsedUs is how far now is into the window starting at start, clamped to
// [0, window].
func (s *shape) elapsedUs(start, now time.Time) int64 {
	return min(max(now.Sub(start).Microseconds(), 0), s.windowUs)
}

// slidingEstimate is the sliding window's count, rounded up:
// cur + ceil(prev*(w-e)/w), computed exactly in 128 bits and saturating at
// math.MaxInt64. All inputs are non-negative.
func slidingEstimate(prev, cur, e, w int64) int64 {
	hi, lo := bits.Mul64(uint64(prev), uint64(w-e))
	q, r := bits.Div64(hi, lo, uint64(w)) // q <= prev: hi < w
	if r > 0 {
		q++
	}
	return satAdd(cur, int64(q))
}

// slidingFits reports prev*(w-e) + (cur+cost)*w <= limit*w, computed exactly
// in 128 bits as the SQL computes it in numeric. All inputs are
// non-negative.
func slidingFits(prev, cur, cost, e, w, limit int64) bool {
	h1, l1 := bits.Mul64(uint64(prev), uint64(w-e))
	h2, l2 := bits.Mul64(uint64(cur)+uint64(cost), uint64(w)) // cur+cost < 2^64
	lo, carry := bits.Add64(l1, l2, 0)
	hi, _ := bits.Add64(h1, h2, carry)
	rh, rl := bits.Mul64(uint64(limit), uint64(w))
	return hi < rh || (hi == rh && lo <= rl)
}

// slidingDecision builds a sliding-window decision from the row's state
// after the check.
func (s *shape) slidingDecision(allowed bool, start time.Time, cur, prev int64, now time.Time, cost int64) Decision {
	w := s.windowUs
	e := s.elapsedUs(start, now)
	used := slidingEstimate(prev, cur, e, w)
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Limit,
		Used:      used,
		Remaining: max(s.cfg.Limit-used, 0),
		ResetAt:   start.Add(2 * s.cfg.Window),
		Now:       now,
		Store:     StorePostgres,
	}
	if cur == 0 {
		d.ResetAt = start.Add(s.cfg.Window)
	}
	if !allowed {
		d.RetryAfter = max(s.slidingRetryAfter(start, cur, prev, e, cost), 0)
	}
	return d
}

// slidingRetryAfter finds how long until estimate + cost <= limit, with no
// further units counted: the previous window's weight shrinks through the
// current window, then the current count becomes the previous one.
func (s *shape) slidingRetryAfter(start time.Time, cur, prev, e, cost int64) time.Duration {
	w := float64(s.windowUs)
	room := float64(s.cfg.Limit - cur - cost)
	if room >= 0 && prev > 0 {
		// Within this window: prev*(w-x)/w <= room  <=>  x >= w - room*w/prev.
		x := math.Ceil(w - room*w/float64(prev))
		if x <= w {
			return usToDuration(x - float64(e))
		}
	}
	// In the next window the current count weighs as the previous one:
	// cur*(w-x)/w + cost <= limit  <=>  x >= w - (limit-cost)*w/cur.
	x := 0.0
	if cur > 0 {
		x = max(math.Ceil(w-float64(s.cfg.Limit-cost)*w/float64(cur)), 0)
	}
	return usToDuration(w - float64(e) + x)
}

// In memory, st.at is the current window's start, st.count and st.prev the
// units counted in it and in the one before.

func (slidingWindow) fresh(m *MemoryLimiter, now int64) memState {
	return memState{at: m.windowStart(now)}
}

func (slidingWindow) dead(m *MemoryLimiter, st memState, now int64) bool {
	return st.at < m.windowStart(now)-m.windowUs
}

func (slidingWindow) roll(m *MemoryLimiter, st memState, now int64) memState {
	ws := m.windowStart(now)
	switch {
	case st.at >= ws:
	case st.at == ws-m.windowUs:
		st.at, st.count, st.prev = ws, 0, st.count
	default:
		st.at, st.count, st.prev = ws, 0, 0
	}
	return st
}

func (slidingWindow) takeMemory(m *MemoryLimiter, st memState, now, cost int64, upTo bool) (memState, bool, int64) {
	return slidingWindowStep(st.at, st.count, st.prev, now, m.windowUs, cost, m.cfg.Limit, m.cfg.Penalty, upTo)
}

func (slidingWindow) decideMemory(m *MemoryLimiter, allowed bool, st memState, now, cost int64) Decision {
	return m.slidingDecision(allowed, usTime(st.at), st.count, st.prev, usTime(now), cost)
}

func (slidingWindow) peekMemory(m *MemoryLimiter, st memState, now int64) Decision {
	e := min(max(now-st.at, 0), m.windowUs)
	allowed := slidingFits(st.prev, st.count, 1, e, m.windowUs, m.cfg.Limit)
	return m.slidingDecision(allowed, usTime(st.at), st.count, st.prev, usTime(now), 1)
}
