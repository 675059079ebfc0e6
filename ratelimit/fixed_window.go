package ratelimit

import (
	"context"
	"math"
	"time"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// fixedWindow counts units in windows aligned on multiples of Window since
// the Unix epoch. Its table may be partitioned on the windows' ends.
type fixedWindow struct{}

func (fixedWindow) validate(Config) error              { return nil }
func (fixedWindow) capacity(c Config) int64            { return c.Limit }
func (fixedWindow) fallbackConfig(_, fb Config) Config { return fb }
func (fixedWindow) spreadRow(row Config) Config        { return row }
func (fixedWindow) table() string                      { return "pgrl_fixed_window" }
func (fixedWindow) partitioned() bool                  { return true }
func (fixedWindow) lockRank() int                      { return 0 }

func (fixedWindow) take(ctx context.Context, l *Limiter, db DB, k []byte, cost int64) (Decision, error) {
	r, err := l.q.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
		Key: k, At: l.at(), WindowUs: l.windowUs, Cost: cost, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)), nil
}

func (fixedWindow) takePolicy(ctx context.Context, l *Limiter, db DB, k, ok []byte, cost int64) (Decision, error) {
	r, err := sqlops.New().FixedWindowTakePolicy(ctx, db, sqlops.FixedWindowTakePolicyParams{
		Key: k, Cost: cost, At: l.at(), WindowUs: l.windowUs,
		Policy: l.cfg.Policy, OverrideKey: ok, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	if err != nil {
		return Decision{}, l.policyErr(err)
	}
	s := l.applied(Rate{Limit: r.MaxCount, Window: l.cfg.Window})
	return s.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)), nil
}

func (fixedWindow) takeUnderPolicy(ctx context.Context, l *Limiter, db DB, k []byte, cost, revision int64) (Decision, error) {
	r, err := sqlops.New().FixedWindowTakeUnderPolicy(ctx, db, sqlops.FixedWindowTakeUnderPolicyParams{
		Key: k, Cost: cost, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
		Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode), OverridesRevision: revision,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)), nil
}

func (fixedWindow) takeMany(ctx context.Context, l *Limiter, db DB, keys [][]byte, costs []int64) ([]Decision, error) {
	rows, err := sqlops.New().FixedWindowTakeMany(ctx, db, sqlops.FixedWindowTakeManyParams{
		Keys: keys, Costs: costs, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	return inKeyOrder(keys, rows, err, func(row sqlops.FixedWindowTakeManyRow) string { return row.KeyHex },
		func(row sqlops.FixedWindowTakeManyRow, _ int) Decision {
			return l.fixedDecision(row.Allowed, row.Count, usTime(row.ExpiresAtUs), usTime(row.NowUs))
		})
}

func (fixedWindow) takeManyPolicy(ctx context.Context, l *Limiter, db DB, keys, okeys [][]byte, costs []int64) ([]Decision, []bool, error) {
	rows, err := sqlops.New().FixedWindowTakeManyPolicy(ctx, db, sqlops.FixedWindowTakeManyPolicyParams{
		Keys: keys, OverrideKeys: okeys, Costs: costs, At: l.at(), WindowUs: l.windowUs,
		Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	return someInKeyOrder(keys, rows, err, func(row sqlops.FixedWindowTakeManyPolicyRow) string { return row.KeyHex },
		func(row sqlops.FixedWindowTakeManyPolicyRow, _ int) Decision {
			s := l.applied(Rate{Limit: row.MaxCount, Window: l.cfg.Window})
			return s.fixedDecision(row.Allowed, row.Count, usTime(row.ExpiresAtUs), usTime(row.NowUs))
		})
}

func (fixedWindow) takeUpTo(ctx context.Context, l *Limiter, db DB, k []byte, n int64) (Decision, error) {
	r, err := l.q.FixedWindowTakeUpTo(ctx, db, gen.FixedWindowTakeUpToParams{
		Key: k, N: n, At: l.at(), WindowUs: l.windowUs, MaxCount: l.cfg.Limit, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)).granting(r.Granted), nil
}

func (fixedWindow) takeQueue(ctx context.Context, db DB, q *checkQueue) ([]Decision, error) {
	p := sqlops.FixedWindowTakeChecksParams{
		Keys:      q.keys,
		MaxCounts: q.limits(),
		WindowsUs: q.windowsUs(),
		Penalties: q.penalties(),
		Runs:      q.runs, Ends: q.ends, Rows: q.rows, Costs: q.costs, UpTo: q.upTo, Vetoes: q.vetoes,
		Mins: q.mins, Shares: q.shares, At: q.clock(),
	}
	if q.policies != nil {
		return fixedWindow{}.takePolicyQueue(ctx, db, q, p)
	}
	var rows []sqlops.FixedWindowTakeChecksRow
	var err error
	replayed := false
	if r := q.request; r == nil {
		rows, err = sqlops.New().FixedWindowTakeChecks(ctx, db, p)
	} else if q.lone() {
		rows, replayed, err = takeOrReplay(func() ([]sqlops.FixedWindowTakeChecksRow, error) {
			once, err := sqlops.New().FixedWindowTakeOnce(ctx, db, sqlops.FixedWindowTakeOnceParams{
				RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs, Key: p.Keys[0], At: p.At,
				WindowUs: p.WindowsUs[0], Cost: p.Costs[0], MaxCount: p.MaxCounts[0], Penalty: p.Penalties[0],
			})
			return rowsAs(once, func(o sqlops.FixedWindowTakeOnceRow) sqlops.FixedWindowTakeChecksRow {
				return sqlops.FixedWindowTakeChecksRow(o)
			}), err
		}, func() ([]sqlops.FixedWindowTakeChecksRow, error) {
			stored, err := sqlops.New().FixedWindowAnswer(ctx, db, sqlops.FixedWindowAnswerParams{
				RequestKey: r.key, RequestID: r.id,
			})
			return rowsAs(stored, func(o sqlops.FixedWindowAnswerRow) sqlops.FixedWindowTakeChecksRow {
				return sqlops.FixedWindowTakeChecksRow(o)
			}), err
		})
	} else {
		var once []sqlops.FixedWindowTakeChecksOnceRow
		once, err = sqlops.New().FixedWindowTakeChecksOnce(ctx, db, sqlops.FixedWindowTakeChecksOnceParams{
			RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs,
			Keys: p.Keys, MaxCounts: p.MaxCounts, WindowsUs: p.WindowsUs, Penalties: p.Penalties, Runs: p.Runs,
			Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes, Mins: p.Mins,
			Shares: p.Shares, At: p.At,
		})
		for _, o := range once {
			rows = append(rows, sqlops.FixedWindowTakeChecksRow{CheckIndex: o.CheckIndex, Granted: o.Granted,
				Count: o.Count, Allowed: o.Allowed, ExpiresAtUs: o.ExpiresAtUs, NowUs: o.NowUs})
			replayed = replayed || o.Replayed
		}
	}
	decs, err := inCheckOrder(q, rows, err, fixedCheckIndex, fixedChecked)
	markReplayed(decs, replayed)
	return decs, err
}

func fixedCheckIndex(r sqlops.FixedWindowTakeChecksRow) int32 { return r.CheckIndex }

// fixedChecked is the decision of a check statement's row.
func fixedChecked(l *Limiter, r sqlops.FixedWindowTakeChecksRow, _ ask) Decision {
	return l.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)).granting(r.Granted)
}

func (fixedWindow) takeRuns(ctx context.Context, db DB, q *checkQueue) ([]Decision, []bool, error) {
	rows, err := sqlops.New().FixedWindowTakeRuns(ctx, db, sqlops.FixedWindowTakeRunsParams{
		Keys:      q.keys,
		Rows:      q.rows,
		Ends:      q.ends,
		MaxCounts: q.limits(),
		WindowsUs: q.windowsUs(),
		At:        q.clock(),
	})
	return someInCheckOrder(q, rowsAs(rows, func(r sqlops.FixedWindowTakeRunsRow) sqlops.FixedWindowTakeChecksRow {
		return sqlops.FixedWindowTakeChecksRow(r)
	}), err, fixedCheckIndex, fixedChecked)
}

// takePolicyQueue is takeQueue for a queue with rows that read their
// stored policy (checkQueue.policies): each check is decided at the limit
// its row read.
func (fixedWindow) takePolicyQueue(ctx context.Context, db DB, q *checkQueue, p sqlops.FixedWindowTakeChecksParams) ([]Decision, error) {
	rows, err := sqlops.New().FixedWindowTakePolicyChecks(ctx, db, sqlops.FixedWindowTakePolicyChecksParams{
		Keys: p.Keys, MaxCounts: p.MaxCounts, WindowsUs: p.WindowsUs, Penalties: p.Penalties, Runs: p.Runs,
		Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes, Mins: p.Mins, Shares: p.Shares,
		At: p.At, Policies: q.policies, OverrideKeys: q.overrideKeys, KeyModes: q.keyModes,
	})
	if err == nil && len(rows) == 0 && len(q.costs) > 0 {
		return nil, errPolicyMismatch
	}
	return inCheckOrder(q, rows, err, func(r sqlops.FixedWindowTakePolicyChecksRow) int32 { return r.CheckIndex },
		func(l *Limiter, r sqlops.FixedWindowTakePolicyChecksRow, _ ask) Decision {
			s := l.applied(Rate{Limit: r.MaxCount, Window: l.cfg.Window})
			return s.fixedDecision(r.Allowed, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)).granting(r.Granted)
		})
}

// refund takes n units off the window r counted them in, by a check of
// cost -n pinned to r's instant, while that window lasts: units of a window
// that has ended no longer count. A count that the refund took below zero
// (the key was reset in between) is put back to zero: the refund gives back
// only what is there.
func (fixedWindow) refund(ctx context.Context, l *Limiter, db DB, k []byte, r reservation, n int64) (int64, error) {
	if r.ExpiresAtUs <= r.settledAtUs {
		return 0, nil
	}
	p := gen.FixedWindowTakeParams{Key: k, WindowUs: l.windowUs, Cost: -n, MaxCount: math.MaxInt64, Penalty: true}
	at := usTime(r.NowUs)
	p.At = &at
	row, err := l.q.FixedWindowTake(ctx, db, p)
	if err != nil || row.Count >= 0 {
		return n, err
	}
	p.Cost = -row.Count
	_, err = l.q.FixedWindowTake(ctx, db, p)
	return n + row.Count, err
}

func (fixedWindow) peek(ctx context.Context, l *Limiter, db DB, k []byte) (Decision, error) {
	r, err := l.q.FixedWindowPeek(ctx, db, gen.FixedWindowPeekParams{
		Key: k, At: l.at(), WindowUs: l.windowUs,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.fixedDecision(r.Count < l.cfg.Limit, r.Count, usTime(r.ExpiresAtUs), usTime(r.NowUs)), nil
}

func (fixedWindow) reset(ctx context.Context, l *Limiter, db DB, k []byte) error {
	_, err := l.q.FixedWindowReset(ctx, db, k)
	return err
}

// fixedDecision builds a fixed-window decision from the window's state.
func (s *shape) fixedDecision(allowed bool, count int64, expiresAt, now time.Time) Decision {
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Limit,
		Used:      count,
		Remaining: max(s.cfg.Limit-count, 0),
		ResetAt:   expiresAt,
		Now:       now,
		Store:     StorePostgres,
	}
	if !allowed {
		// The next window admits any valid cost.
		d.RetryAfter = max(expiresAt.Sub(now), 0)
	}
	return d
}

// In memory, st.at is the window's end and st.count the units counted in it.

func (fixedWindow) fresh(m *MemoryLimiter, now int64) memState {
	return memState{at: m.windowEnd(now)}
}

func (fixedWindow) dead(_ *MemoryLimiter, st memState, now int64) bool { return st.at <= now }

func (fixedWindow) roll(m *MemoryLimiter, st memState, now int64) memState {
	if end := m.windowEnd(now); st.at != end {
		st = memState{at: end}
	}
	return st
}

func (fixedWindow) takeMemory(m *MemoryLimiter, st memState, now, cost int64, upTo bool) (memState, bool, int64) {
	// One window per key: with the monotonic clock windows only move
	// forward, so the current one is all that matters.
	end, count := fixedWindowRow(st.at, st.count, now, m.windowUs)
	return fixedWindowStep(end, count, cost, m.cfg.Limit, m.cfg.Penalty, upTo)
}

func (fixedWindow) decideMemory(m *MemoryLimiter, allowed bool, st memState, now, _ int64) Decision {
	return m.fixedDecision(allowed, st.count, usTime(st.at), usTime(now))
}

func (fixedWindow) peekMemory(m *MemoryLimiter, st memState, now int64) Decision {
	return m.fixedDecision(st.count < m.cfg.Limit, st.count, usTime(st.at), usTime(now))
}
