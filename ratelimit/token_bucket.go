package ratelimit

import (
	"context"
	"math"
	"math/big"
	"time"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// tokenBucket holds up to Burst tokens and refills Limit per Window,
// continuously. Balances are float8 in PostgreSQL and float64 in memory.
type tokenBucket struct{}

// MaxTokens is the largest token-bucket Burst (and so cost) a limiter
// accepts: 2^53, the largest range in which a float8 balance, as PostgreSQL
// and the memory tier keep it, counts every single token exactly.
const MaxTokens = 1 << 53

// TokenBucketLeaseTime is how long a lease's slice of a token bucket may be
// used after the instant it was taken at (the now_us the slice statement
// returns; its lease_expires_us is that plus this). PostgreSQL counts the
// units of a slice against the bucket's capacity until the end of the lease
// epoch after the one it was taken in (epochs of this length, aligned on
// multiples of it since the Unix epoch), so the capacity is lowered by at
// most the units leased in the current and the previous epoch. It is
// pgrl_token_bucket_lease_us in migration 000016.
const TokenBucketLeaseTime = time.Second

// maxRefillUs is the longest an empty token bucket may take to refill:
// 1,000 years, in microseconds. Refill instants (twice that under penalty)
// then stay far inside PostgreSQL's interval and timestamp ranges.
const maxRefillUs = 1000 * 36525 * 24 * 3600 * 1_000_000 / 100

// validate refuses token buckets whose balance or refill times cannot be
// computed exactly: a Burst beyond MaxTokens, or an empty bucket that takes
// longer than 1,000 years to refill (its refill instants would leave the
// range of PostgreSQL's intervals).
func (tokenBucket) validate(c Config) error {
	if c.Burst > MaxTokens {
		return invalid(ErrInvalidBurst, "%d for %q; a token bucket holds at most %d tokens (exactly, as a float8): lower Burst (it defaults to Limit), or count in larger units", c.Burst, c.Name, int64(MaxTokens))
	}
	// Burst/Limit*Window <= 1,000 years, in integers that cannot overflow.
	fill := new(big.Int).Mul(big.NewInt(c.Burst), big.NewInt(c.Window.Microseconds()))
	most := new(big.Int).Mul(big.NewInt(c.Limit), big.NewInt(maxRefillUs))
	if fill.Cmp(most) > 0 {
		return invalid(ErrInvalidBurst, "burst %d at %d per %v for %q: an empty bucket would take more than 1,000 years to refill; raise Limit, shorten Window or lower Burst", c.Burst, c.Limit, c.Window, c.Name)
	}
	return nil
}

func (tokenBucket) capacity(c Config) int64 { return c.Burst }

// fallbackConfig keeps the bucket's shape: the burst scales with the limit
// (Burst*FallbackLimit/Limit, in 128 bits: the product can overflow int64).
func (tokenBucket) fallbackConfig(cfg, fb Config) Config {
	fb.Burst = max(1, mulDiv(cfg.Burst, cfg.FallbackLimit, cfg.Limit))
	return fb
}

// spreadRow makes every row refill at its share of the rate, at least one
// token per Window.
func (tokenBucket) spreadRow(row Config) Config {
	row.Limit = max(row.Limit, 1)
	return row
}

func (tokenBucket) table() string     { return "pgrl_token_bucket" }
func (tokenBucket) partitioned() bool { return false }
func (tokenBucket) lockRank() int     { return 1 }

func (tokenBucket) take(ctx context.Context, l *Limiter, db DB, k []byte, cost int64) (Decision, error) {
	r, err := l.q.TokenBucketTake(ctx, db, gen.TokenBucketTakeParams{
		Key: k, At: l.at(), Cost: cost, Capacity: float64(l.cfg.Burst),
		RefillPerUs: l.refillPerUs, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs), usTime(r.FullAtUs), cost), nil
}

func (tokenBucket) takePolicy(ctx context.Context, l *Limiter, db DB, k, ok []byte, cost int64) (Decision, error) {
	r, err := sqlops.New().TokenBucketTakePolicy(ctx, db, sqlops.TokenBucketTakePolicyParams{
		Key: k, Cost: cost, At: l.at(),
		Policy: l.cfg.Policy, OverrideKey: ok, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	if err != nil {
		return Decision{}, l.policyErr(err)
	}
	s := l.applied(Rate{Limit: r.Limit, Window: time.Duration(r.WindowUs) * time.Microsecond, Burst: r.Burst})
	return s.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs), usTime(r.FullAtUs), cost), nil
}

func (tokenBucket) takeUnderPolicy(ctx context.Context, l *Limiter, db DB, k []byte, cost, revision int64) (Decision, error) {
	r, err := sqlops.New().TokenBucketTakeUnderPolicy(ctx, db, sqlops.TokenBucketTakeUnderPolicyParams{
		Key: k, Cost: cost, At: l.at(), Capacity: float64(l.cfg.Burst), RefillPerUs: l.refillPerUs,
		Penalty: l.cfg.Penalty, Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode),
		RateLimit: l.cfg.Limit, Burst: l.cfg.Burst, WindowUs: l.windowUs, OverridesRevision: revision,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs), usTime(r.FullAtUs), cost), nil
}

func (tokenBucket) takeMany(ctx context.Context, l *Limiter, db DB, keys [][]byte, costs []int64) ([]Decision, error) {
	rows, err := sqlops.New().TokenBucketTakeMany(ctx, db, sqlops.TokenBucketTakeManyParams{
		Keys: keys, Costs: costs, At: l.at(), Capacity: float64(l.cfg.Burst),
		RefillPerUs: l.refillPerUs, Penalty: l.cfg.Penalty,
	})
	return inKeyOrder(keys, rows, err, func(row sqlops.TokenBucketTakeManyRow) string { return row.KeyHex },
		func(row sqlops.TokenBucketTakeManyRow, i int) Decision {
			return l.tokenDecision(row.Allowed, math.Float64frombits(uint64(row.TokensBits)), usTime(row.UpdatedAtUs), usTime(row.FullAtUs), costs[i])
		})
}

func (tokenBucket) takeManyPolicy(ctx context.Context, l *Limiter, db DB, keys, okeys [][]byte, costs []int64) ([]Decision, []bool, error) {
	rows, err := sqlops.New().TokenBucketTakeManyPolicy(ctx, db, sqlops.TokenBucketTakeManyPolicyParams{
		Keys: keys, OverrideKeys: okeys, Costs: costs, At: l.at(),
		Policy: l.cfg.Policy, KeyMode: keyModeText(l.cfg.KeyMode),
	})
	return someInKeyOrder(keys, rows, err, func(row sqlops.TokenBucketTakeManyPolicyRow) string { return row.KeyHex },
		func(row sqlops.TokenBucketTakeManyPolicyRow, i int) Decision {
			s := l.applied(Rate{Limit: row.Limit, Window: time.Duration(row.WindowUs) * time.Microsecond, Burst: row.Burst})
			return s.tokenDecision(row.Allowed, math.Float64frombits(uint64(row.TokensBits)), usTime(row.UpdatedAtUs), usTime(row.FullAtUs), costs[i])
		})
}

func (tokenBucket) takeUpTo(ctx context.Context, l *Limiter, db DB, k []byte, n int64) (Decision, error) {
	r, err := l.q.TokenBucketTakeUpTo(ctx, db, gen.TokenBucketTakeUpToParams{
		Key: k, N: n, At: l.at(), Capacity: float64(l.cfg.Burst), RefillPerUs: l.refillPerUs, Penalty: l.cfg.Penalty,
	})
	if err != nil {
		return Decision{}, err
	}
	return l.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs), usTime(r.FullAtUs), 1).granting(r.Granted), nil
}

func (tokenBucket) takeQueue(ctx context.Context, db DB, q *checkQueue) ([]Decision, error) {
	p := sqlops.TokenBucketTakeChecksParams{
		Keys:         q.keys,
		Capacities:   q.capacities(),
		RefillsPerUs: q.refillsPerUs(),
		Penalties:    q.penalties(),
		Runs:         q.runs, Ends: q.ends, Rows: q.rows, Costs: q.costs, UpTo: q.upTo, Vetoes: q.vetoes,
		Mins: q.mins, Shares: q.shares, At: q.clock(),
	}
	if q.policies != nil {
		return tokenBucket{}.takePolicyQueue(ctx, db, q, p)
	}
	var rows []sqlops.TokenBucketTakeChecksRow
	var err error
	replayed := false
	if r := q.request; r == nil {
		rows, err = sqlops.New().TokenBucketTakeChecks(ctx, db, p)
	} else if q.lone() {
		rows, replayed, err = takeOrReplay(func() ([]sqlops.TokenBucketTakeChecksRow, error) {
			once, err := sqlops.New().TokenBucketTakeOnce(ctx, db, sqlops.TokenBucketTakeOnceParams{
				RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs, Key: p.Keys[0], At: p.At,
				Capacity: p.Capacities[0], RefillPerUs: p.RefillsPerUs[0], Cost: p.Costs[0], Penalty: p.Penalties[0],
			})
			return rowsAs(once, func(o sqlops.TokenBucketTakeOnceRow) sqlops.TokenBucketTakeChecksRow {
				return sqlops.TokenBucketTakeChecksRow(o)
			}), err
		}, func() ([]sqlops.TokenBucketTakeChecksRow, error) {
			stored, err := sqlops.New().TokenBucketAnswer(ctx, db, sqlops.TokenBucketAnswerParams{
				RequestKey: r.key, RequestID: r.id,
			})
			return rowsAs(stored, func(o sqlops.TokenBucketAnswerRow) sqlops.TokenBucketTakeChecksRow {
				return sqlops.TokenBucketTakeChecksRow(o)
			}), err
		})
	} else {
		var once []sqlops.TokenBucketTakeChecksOnceRow
		once, err = sqlops.New().TokenBucketTakeChecksOnce(ctx, db, sqlops.TokenBucketTakeChecksOnceParams{
			RequestKey: r.key, RequestID: r.id, RetainUs: r.retainUs,
			Keys: p.Keys, Capacities: p.Capacities, RefillsPerUs: p.RefillsPerUs, Penalties: p.Penalties,
			Runs: p.Runs, Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes,
			Mins: p.Mins, Shares: p.Shares, At: p.At,
		})
		for _, o := range once {
			rows = append(rows, sqlops.TokenBucketTakeChecksRow{CheckIndex: o.CheckIndex, Granted: o.Granted,
				TokensBits: o.TokensBits, UpdatedAtUs: o.UpdatedAtUs, FullAtUs: o.FullAtUs, Allowed: o.Allowed})
			replayed = replayed || o.Replayed
		}
	}
	decs, err := inCheckOrder(q, rows, err, tokenCheckIndex, tokenChecked)
	markReplayed(decs, replayed)
	return decs, err
}

func tokenCheckIndex(r sqlops.TokenBucketTakeChecksRow) int32 { return r.CheckIndex }

// tokenChecked is the decision of a check statement's row.
func tokenChecked(l *Limiter, r sqlops.TokenBucketTakeChecksRow, a ask) Decision {
	return l.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs),
		usTime(r.FullAtUs), a.retryCost()).granting(r.Granted)
}

func (tokenBucket) takeRuns(ctx context.Context, db DB, q *checkQueue) ([]Decision, []bool, error) {
	rows, err := sqlops.New().TokenBucketTakeRuns(ctx, db, sqlops.TokenBucketTakeRunsParams{
		Keys:         q.keys,
		Rows:         q.rows,
		Ends:         q.ends,
		Capacities:   q.capacities(),
		RefillsPerUs: q.refillsPerUs(),
		At:           q.clock(),
	})
	return someInCheckOrder(q, rowsAs(rows, func(r sqlops.TokenBucketTakeRunsRow) sqlops.TokenBucketTakeChecksRow {
		return sqlops.TokenBucketTakeChecksRow(r)
	}), err, tokenCheckIndex, tokenChecked)
}

// takePolicyQueue is takeQueue for a queue with rows that read their
// stored policy (checkQueue.policies): each check of such a row is decided
// at the rate its row read (a plain row's checks come back with rate 0).
func (tokenBucket) takePolicyQueue(ctx context.Context, db DB, q *checkQueue, p sqlops.TokenBucketTakeChecksParams) ([]Decision, error) {
	rows, err := sqlops.New().TokenBucketTakePolicyChecks(ctx, db, sqlops.TokenBucketTakePolicyChecksParams{
		Keys: p.Keys, Capacities: p.Capacities, RefillsPerUs: p.RefillsPerUs, Penalties: p.Penalties,
		Runs: p.Runs, Ends: p.Ends, Rows: p.Rows, Costs: p.Costs, UpTo: p.UpTo, Vetoes: p.Vetoes, Mins: p.Mins,
		Shares: p.Shares, At: p.At, Policies: q.policies, OverrideKeys: q.overrideKeys, KeyModes: q.keyModes,
	})
	if err == nil && len(rows) == 0 && len(q.costs) > 0 {
		return nil, errPolicyMismatch
	}
	return inCheckOrder(q, rows, err, func(r sqlops.TokenBucketTakePolicyChecksRow) int32 { return r.CheckIndex },
		func(l *Limiter, r sqlops.TokenBucketTakePolicyChecksRow, a ask) Decision {
			s := &l.shape
			if r.Limit > 0 {
				s = l.applied(Rate{Limit: r.Limit, Window: time.Duration(r.WindowUs) * time.Microsecond, Burst: r.Burst})
			}
			return s.tokenDecision(r.Allowed, math.Float64frombits(uint64(r.TokensBits)), usTime(r.UpdatedAtUs),
				usTime(r.FullAtUs), a.retryCost()).granting(r.Granted)
		})
}

// refund puts n tokens back, by a check of cost -n: the bucket refilled to
// the settlement's instant, then n added. A balance above the capacity is
// cut to it by the next check's refill, so a bucket that has refilled in
// the meantime gets back only what it has room for.
func (tokenBucket) refund(ctx context.Context, l *Limiter, db DB, k []byte, _ reservation, n int64) (int64, error) {
	decs, err := l.alg.takeQueue(ctx, db, newCheckQueue([]*pendingCheck{{l: l, skey: k, ask: ask{n: -n}}}))
	if err != nil {
		return 0, err
	}
	return n - min(max(decs[0].Remaining-decs[0].Limit, 0), n), nil
}

func (tokenBucket) peek(ctx context.Context, l *Limiter, db DB, k []byte) (Decision, error) {
	r, err := l.q.TokenBucketPeek(ctx, db, gen.TokenBucketPeekParams{
		Key: k, At: l.at(), Capacity: float64(l.cfg.Burst), RefillPerUs: l.refillPerUs,
	})
	if err != nil {
		return Decision{}, err
	}
	tokens, now := math.Float64frombits(uint64(r.TokensBits)), usTime(r.NowUs)
	fullAt := now.Add(usToDuration((float64(l.cfg.Burst) - tokens) / l.refillPerUs))
	return l.tokenDecision(tokens >= 1, tokens, now, fullAt, 1), nil
}

func (tokenBucket) reset(ctx context.Context, l *Limiter, db DB, k []byte) error {
	_, err := l.q.TokenBucketReset(ctx, db, k)
	return err
}

// tokenDecision builds a token-bucket decision from the balance after the
// check, taken at instant at.
func (s *shape) tokenDecision(allowed bool, tokens float64, at, fullAt time.Time, cost int64) Decision {
	d := Decision{
		Allowed:   allowed,
		Limit:     s.cfg.Burst,
		Used:      tokensUsed(s.cfg.Burst, tokens),
		Remaining: int64(math.Floor(max(tokens, 0))),
		ResetAt:   fullAt,
		Now:       at,
		Store:     StorePostgres,
	}
	if !allowed {
		d.RetryAfter = max(usToDuration((float64(cost)-tokens)/s.refillPerUs), 0)
	}
	return d
}

// tokensUsed is what a balance of tokens lacks from a full bucket of burst,
// in whole tokens rounded up: burst - floor(tokens). Under penalty the
// balance can be down to -burst, so this is up to 2*burst; it is exact
// (burst and |tokens| are at most 2^53) and saturates at math.MaxInt64.
func tokensUsed(burst int64, tokens float64) int64 {
	f := math.Floor(tokens)
	if f >= 0 {
		return max(burst-int64(f), 0)
	}
	return satAdd(burst, int64(-f))
}

// In memory, st.at is the last update and st.tokens the balance then.

func (tokenBucket) fresh(m *MemoryLimiter, now int64) memState {
	return memState{at: now, tokens: m.capacity}
}

func (tokenBucket) dead(m *MemoryLimiter, st memState, now int64) bool {
	return st.at <= now && st.tokens+float64(now-st.at)*m.refillPerUs >= m.capacity
}

func (tokenBucket) roll(m *MemoryLimiter, st memState, now int64) memState {
	st.tokens = min(m.capacity, st.tokens+float64(max(now-st.at, 0))*m.refillPerUs)
	st.at = now
	return st
}

func (tokenBucket) takeMemory(m *MemoryLimiter, st memState, now, cost int64, upTo bool) (memState, bool, int64) {
	return tokenBucketStep(st.tokens, st.at, now, cost, m.capacity, m.refillPerUs, m.cfg.Penalty, upTo)
}

func (tokenBucket) decideMemory(m *MemoryLimiter, allowed bool, st memState, _, cost int64) Decision {
	// full_at = at + (capacity - tokens)/refill, rounded as PostgreSQL
	// rounds interval * float8: to the nearest microsecond, ties to even.
	fullAt := st.at + int64(math.RoundToEven((m.capacity-st.tokens)/m.refillPerUs))
	return m.tokenDecision(allowed, st.tokens, usTime(st.at), usTime(fullAt), cost)
}

func (tokenBucket) peekMemory(m *MemoryLimiter, st memState, now int64) Decision {
	fullAt := usTime(now).Add(usToDuration((m.capacity - st.tokens) / m.refillPerUs))
	return m.tokenDecision(st.tokens >= 1, st.tokens, usTime(now), fullAt, 1)
}
