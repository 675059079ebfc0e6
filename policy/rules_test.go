package policy_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// The configuration rules have one source, ratelimit.Config (and
// ratelimit.PolicyNamePattern for names); pgrl_policy's CHECK constraints
// restate them in SQL for callers that write the table directly. This test
// holds the two together: on every edge of every rule (the name pattern, the
// window range, the token bucket's 2^53 tokens and 1,000-year refill, the
// limit) a policy is accepted by Policy.Validate exactly when the table
// accepts it.
func TestConfigRulesAreTheTablesRules(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()

	const day = 24 * time.Hour
	// The largest burst a token bucket refilling limit per window may
	// have: it refills within 1,000 years (365.25 days each).
	maxBurst := func(limit int64, window time.Duration) int64 {
		return int64(float64(limit) * 1000 * 365.25 * float64(day/time.Microsecond) / float64(window/time.Microsecond))
	}
	tb := func(limit int64, window time.Duration, burst int64) policy.Policy {
		return policy.Policy{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: limit, Window: window, Burst: burst}
	}
	fw := func(name string, limit int64, window time.Duration) policy.Policy {
		return policy.Policy{Name: name, Algorithm: ratelimit.FixedWindow, Limit: limit, Window: window}
	}
	cases := []policy.Policy{
		// Names.
		fw("a", 1, time.Minute),
		fw("A9_.:/+-z", 1, time.Minute),
		fw(strings.Repeat("n", 128), 1, time.Minute),
		fw(strings.Repeat("n", 129), 1, time.Minute),
		fw("", 1, time.Minute),
		fw("-a", 1, time.Minute),
		fw("_a", 1, time.Minute),
		fw("a b", 1, time.Minute),
		fw("a@b", 1, time.Minute),
		fw("a\nb", 1, time.Minute),
		fw("é", 1, time.Minute),
		fw("a'; DROP TABLE pgrl_policy; --", 1, time.Minute),
		{Name: "a:b", Limit: 1, Window: time.Minute, KeyMode: ratelimit.ReadableKeys},
		{Name: "a.b", Limit: 1, Window: time.Minute, KeyMode: ratelimit.ReadableKeys},
		// Limits.
		fw("l", 0, time.Minute),
		fw("l", -1, time.Minute),
		fw("l", math.MinInt64, time.Minute),
		fw("l", math.MaxInt64, time.Minute),
		// Windows.
		fw("w", 1, ratelimit.MinWindow-time.Microsecond),
		fw("w", 1, ratelimit.MinWindow),
		fw("w", 1, ratelimit.MaxWindow),
		fw("w", 1, ratelimit.MaxWindow+time.Microsecond),
		fw("w", 1, 0),
		fw("w", 1, -time.Minute),
		{Name: "w", Algorithm: ratelimit.SlidingWindow, Limit: 1, Window: ratelimit.MaxWindow},
		{Name: "w", Algorithm: ratelimit.SlidingWindow, Limit: 1, Window: ratelimit.MaxWindow + time.Microsecond},
		// The token bucket's capacity.
		tb(1, time.Second, ratelimit.MaxTokens),
		tb(1, time.Second, ratelimit.MaxTokens+1),
		tb(ratelimit.MaxTokens, time.Second, 0),
		tb(ratelimit.MaxTokens+1, time.Second, 0),
		tb(ratelimit.MaxTokens+1, time.Second, 10),
		tb(1, time.Second, -1),
		// Its refill time: within 1,000 years, and not a unit more.
		tb(1, ratelimit.MaxWindow, maxBurst(1, ratelimit.MaxWindow)),
		tb(1, ratelimit.MaxWindow, maxBurst(1, ratelimit.MaxWindow)+1),
		tb(7, 300*day, maxBurst(7, 300*day)),
		tb(7, 300*day, maxBurst(7, 300*day)+1),
		tb(1, 366*day, 0),
	}
	accepted := 0
	for _, p := range cases {
		goErr := p.Validate()
		sqlErr := insertRaw(ctx, t, pool, p)
		require.Equal(t, goErr == nil, sqlErr == nil,
			"%+v: Policy.Validate says %v, the table says %v", p, goErr, sqlErr)
		if goErr == nil {
			accepted++
		}
	}
	// Both sides of every edge were tried.
	require.GreaterOrEqual(t, accepted, 12)
	require.GreaterOrEqual(t, len(cases)-accepted, 20)
}

// insertRaw writes p into pgrl_policy with plain SQL, as a caller without
// package policy would, in a transaction it rolls back, and returns the
// table's refusal: a check-constraint violation, or nil.
func insertRaw(ctx context.Context, t *testing.T, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, p policy.Policy) error {
	t.Helper()
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var burst *int64
	if p.Burst != 0 {
		burst = &p.Burst
	}
	algorithm := p.Algorithm
	if algorithm == "" {
		algorithm = ratelimit.DefaultAlgorithm
	}
	keyMode := "hashed"
	if p.KeyMode == ratelimit.ReadableKeys {
		keyMode = "readable"
	}
	_, err = tx.Exec(ctx, `INSERT INTO pgrl_policy (name, algorithm, "limit", "window", burst, key_mode)
VALUES ($1, $2, $3, make_interval(secs => $4::numeric / 1000000), $5, $6)`,
		p.Name, algorithm, p.Limit, fmt.Sprint(p.Window.Microseconds()), burst, keyMode)
	var pgErr *pgconn.PgError
	if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "23514") {
		t.Fatalf("%+v: not a check violation: %v", p, err)
	}
	return err
}
