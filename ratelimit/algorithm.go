package ratelimit

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
)

// algorithm is everything that differs between the three algorithms: how a
// configuration is checked, which statements a check, a batch, a peek and a
// reset run, how their rows become a Decision, and the in-memory form of
// the same arithmetic. Each algorithm lives in one file (fixed_window.go,
// token_bucket.go, sliding_window.go); the rest of the package calls
// through this interface and never asks which algorithm it holds.
type algorithm interface {
	// validate refuses a configuration (defaults filled in) whose figures
	// the algorithm cannot compute exactly.
	validate(c Config) error
	// capacity is the most units one check can ask for.
	capacity(c Config) int64
	// fallbackConfig adjusts fb, the configuration of the memory tier that
	// answers for cfg under FailToMemory (fb.Limit is already
	// cfg.FallbackLimit).
	fallbackConfig(cfg, fb Config) Config
	// spreadRow adjusts the configuration of one row of a spread limit
	// (its Limit and Burst are already its shares).
	spreadRow(row Config) Config
	// table names the algorithm's table.
	table() string
	// partitioned reports whether the algorithm's table can be
	// partitioned, so that a check can find its partition missing.
	partitioned() bool
	// lockRank orders the algorithms' tables in a multi-limit decision:
	// rows are locked table by table in this order.
	lockRank() int

	// take counts cost units for the stored key k in one statement.
	take(ctx context.Context, l *Limiter, db DB, k []byte, cost int64) (Decision, error)
	// takePolicy is take with the figures read from the stored policy
	// Config.Policy and the key's override in the same statement; ok is the
	// key stored under the policy's name. An empty answer is
	// ErrPolicyChanged.
	takePolicy(ctx context.Context, l *Limiter, db DB, k, ok []byte, cost int64) (Decision, error)
	// takeUnderPolicy is take with the limiter's own figures, counted only
	// while the stored policy Config.Policy holds them and has no override
	// of any key or still has overrides_revision revision (policykeys.go);
	// its row is read in the same statement, and no other policy table.
	// Otherwise nothing is counted, and the error is pgx.ErrNoRows: send
	// takePolicy.
	takeUnderPolicy(ctx context.Context, l *Limiter, db DB, k []byte, cost, revision int64) (Decision, error)
	// takeMany decides checks of distinct stored keys in one statement,
	// as if one after another, and returns their decisions in order.
	takeMany(ctx context.Context, l *Limiter, db DB, keys [][]byte, costs []int64) ([]Decision, error)
	// takeManyPolicy is takeMany with the figures read from the stored
	// policy and each key's override (okeys[i] is keys[i] stored under the
	// policy's name) in the same statement. A key whose policy changed is
	// not counted: decided[i] is false.
	takeManyPolicy(ctx context.Context, l *Limiter, db DB, keys, okeys [][]byte, costs []int64) (decs []Decision, decided []bool, err error)
	// takeUpTo grants k as many of n units as are left, in one statement.
	takeUpTo(ctx context.Context, l *Limiter, db DB, k []byte, n int64) (Decision, error)
	// takeQueue decides q's checks, several per key, in one statement,
	// each key's as if one after another, and returns their decisions in
	// the caller's order (see checkQueue).
	takeQueue(ctx context.Context, db DB, q *checkQueue) ([]Decision, error)
	// takeRuns decides a queue of plain runs (checkQueue.plainRuns) with
	// the run statement, which decides only the checks of keys whose row
	// exists: decided[i] reports whether it decided (and counted) the
	// caller's i-th check.
	takeRuns(ctx context.Context, db DB, q *checkQueue) (decs []Decision, decided []bool, err error)
	// refund gives back n of the units that reservation r (Reserve) of the
	// stored key k took, as far as they still count, and returns how many
	// it gave back.
	refund(ctx context.Context, l *Limiter, db DB, k []byte, r reservation, n int64) (int64, error)
	// peek reports k's state as a check of one unit would see it.
	peek(ctx context.Context, l *Limiter, db DB, k []byte) (Decision, error)
	// reset deletes k's row.
	reset(ctx context.Context, l *Limiter, db DB, k []byte) error

	// fresh is the in-memory state of a key never seen, at now
	// (microseconds since the Unix epoch).
	fresh(m *MemoryLimiter, now int64) memState
	// dead reports whether st no longer affects any check at now or later.
	dead(m *MemoryLimiter, st memState, now int64) bool
	// roll brings st forward to now without counting, as a peek sees it.
	roll(m *MemoryLimiter, st memState, now int64) memState
	// takeMemory applies one check of cost (a partial grant when upTo) to
	// st at now with the algorithm's step (step.go), as the SQL does, and
	// returns the new state, whether the check was allowed and the units
	// granted.
	takeMemory(m *MemoryLimiter, st memState, now, cost int64, upTo bool) (memState, bool, int64)
	// decideMemory builds a check's decision from the state after it.
	decideMemory(m *MemoryLimiter, allowed bool, st memState, now, cost int64) Decision
	// peekMemory builds a peek's decision from the state rolled to now.
	peekMemory(m *MemoryLimiter, st memState, now int64) Decision
}

// algorithms maps each Algorithm to its implementation.
var algorithms = map[Algorithm]algorithm{
	FixedWindow:   fixedWindow{},
	TokenBucket:   tokenBucket{},
	SlidingWindow: slidingWindow{},
	Concurrency:   concurrency{},
}

// algorithmOf returns a's implementation; the empty Algorithm is the
// default, FixedWindow. An unknown name (refused by Config validation
// before any check) also gets the fixed window.
func algorithmOf(a Algorithm) algorithm {
	if impl, ok := algorithms[a]; ok {
		return impl
	}
	return algorithms[FixedWindow]
}

// inKeyOrder gives each of keys the decision that decide makes from the row
// of that key, which keyHex reads (hex-encoded, as the batched statements
// return it); decide receives the key's index in keys. A statement must
// return one row per key, each of a key of the batch.
func inKeyOrder[R any](keys [][]byte, rows []R, err error, keyHex func(R) string, decide func(R, int) Decision) ([]Decision, error) {
	if err == nil && len(rows) != len(keys) {
		return nil, fmt.Errorf("ratelimit: batched statement returned %d rows for %d checks", len(rows), len(keys))
	}
	out, _, err := someInKeyOrder(keys, rows, err, keyHex, decide)
	return out, err
}

// someInKeyOrder is inKeyOrder for a statement that may leave keys out:
// decided[i] reports whether keys[i] came back.
func someInKeyOrder[R any](keys [][]byte, rows []R, err error, keyHex func(R) string, decide func(R, int) Decision) ([]Decision, []bool, error) {
	if err != nil {
		return nil, nil, err
	}
	index := make(map[string]int, len(keys))
	for i, k := range keys {
		index[string(k)] = i
	}
	out := make([]Decision, len(keys))
	decided := make([]bool, len(keys))
	for _, row := range rows {
		k, herr := hex.DecodeString(keyHex(row))
		i, ok := index[string(k)]
		if herr != nil || !ok || decided[i] {
			return nil, nil, errors.New("ratelimit: batched statement returned an unknown key")
		}
		out[i], decided[i] = decide(row, i), true
	}
	return out, decided, nil
}
