package ratelimit_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestOptionsRefusedWhereTheyMeanNothing: options given twice, both Cost
// and UpTo, the zero Option, a count where nothing is counted (Peek,
// Reset) and a rate for a MemoryLimiter are refused with
// ErrInvalidOption, counting nothing, on every verb and its …Tx twin.
func TestOptionsRefusedWhereTheyMeanNothing(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "options", Limit: 5, Window: time.Hour})
	mem, err := ratelimit.NewMemory(ratelimit.Config{Name: "options-mem", Limit: 5, Window: time.Hour}, ratelimit.MemoryOptions{})
	require.NoError(t, err)
	r := ratelimit.AtRate(ratelimit.Rate{Limit: 10, Window: time.Hour})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	for name, opts := range map[string][]ratelimit.Option{
		"cost twice":     {ratelimit.Cost(1), ratelimit.Cost(2)},
		"cost and up to": {ratelimit.Cost(1), ratelimit.UpTo(2)},
		"rate twice":     {r, r},
		"zero option":    {{}},
	} {
		_, err := l.Allow(ctx, "k", opts...)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption, name)
		require.True(t, ratelimit.IsConfigError(err), name)
		_, err = l.AllowTx(ctx, tx, "k", opts...)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption, name)
		_, err = mem.Allow(ctx, "k", opts...)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption, name)
	}
	for _, o := range []ratelimit.Option{ratelimit.Cost(1), ratelimit.UpTo(1)} {
		_, err := l.Peek(ctx, "k", o)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
		_, err = l.PeekTx(ctx, tx, "k", o)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
		require.ErrorIs(t, l.Reset(ctx, "k", o), ratelimit.ErrInvalidOption)
		require.ErrorIs(t, l.ResetTx(ctx, tx, "k", o), ratelimit.ErrInvalidOption)
		_, err = mem.Peek(ctx, "k", o)
		require.ErrorIs(t, err, ratelimit.ErrInvalidOption)
		require.ErrorIs(t, mem.Reset(ctx, "k", o), ratelimit.ErrInvalidOption)
	}
	_, err = mem.Allow(ctx, "k", r)
	require.ErrorContains(t, err, "make a MemoryLimiter per rate")
	for _, n := range []int64{0, -1, math.MinInt64} {
		_, err := l.Allow(ctx, "k", ratelimit.Cost(n))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
		_, err = l.Allow(ctx, "k", ratelimit.UpTo(n))
		require.ErrorIs(t, err, ratelimit.ErrInvalidCost)
	}
	_, err = l.Allow(ctx, "k", ratelimit.AtRate(ratelimit.Rate{Limit: -1, Window: time.Hour}))
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit, "a rate is validated as Config is")
	_, err = l.Allow(ctx, "k", ratelimit.AtRate(ratelimit.Rate{}))
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit, "AtRate of the zero Rate is not the limiter's own rate")
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.Zero(t, p.Used, "no refused check counted")
}

// TestOptionsCompose: the matrix has no holes. A partial grant at a rate,
// a cost at a rate inside a transaction (refunded by its rollback), a peek
// at a rate inside a transaction, and a check of AllowAll at a rate
// (Check.Rate) each count where the same check without the transaction or
// the rate would.
func TestOptionsCompose(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "compose", Limit: 3, Window: time.Hour}, ratelimit.DatabaseOptions{Now: testkit.Pinned(base)})
	big := ratelimit.Rate{Limit: 10, Window: time.Hour}

	d, err := l.Allow(ctx, "k", ratelimit.UpTo(math.MaxInt64), ratelimit.AtRate(big))
	require.NoError(t, err)
	require.Equal(t, int64(10), d.Granted, "UpTo at a rate takes what that rate leaves")
	require.Equal(t, int64(10), d.Limit)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, l.ResetTx(ctx, tx, "k", ratelimit.AtRate(big)))
	d, err = l.AllowTx(ctx, tx, "k", ratelimit.Cost(4), ratelimit.AtRate(big))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	p, err := l.PeekTx(ctx, tx, "k", ratelimit.AtRate(big))
	require.NoError(t, err)
	require.Equal(t, int64(4), p.Used, "the transaction sees its own check")
	require.NoError(t, tx.Rollback(ctx))
	p, err = l.Peek(ctx, "k", ratelimit.AtRate(big))
	require.NoError(t, err)
	require.Equal(t, int64(10), p.Used, "the rollback refunded the check and undid the reset")

	require.NoError(t, l.Reset(ctx, "k"))
	m, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing,
		ratelimit.Check{Limiter: l, Key: "k", Cost: 5, Rate: big},
		ratelimit.Check{Limiter: l, Key: "other"})
	require.NoError(t, err)
	require.True(t, m.Allowed, "5 fits the rate given with the check, not the limiter's 3")
	require.Equal(t, int64(10), m.Decisions[0].Limit)
	require.Equal(t, int64(3), m.Decisions[1].Limit)
	_, err = ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k", Rate: ratelimit.Rate{Limit: -1, Window: time.Hour}})
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit)
}

// TestOptionValue: what Option.Value reports for each kind of option,
// including values a check would refuse.
func TestOptionValue(t *testing.T) {
	t.Parallel()
	r := ratelimit.Rate{Limit: 5, Window: time.Second}
	for _, c := range []struct {
		o    ratelimit.Option
		want ratelimit.OptionValue
	}{
		{ratelimit.Cost(3), ratelimit.OptionValue{Sized: true, Units: 3}},
		{ratelimit.Cost(0), ratelimit.OptionValue{Sized: true}},
		{ratelimit.Cost(math.MinInt64), ratelimit.OptionValue{Sized: true, Units: math.MinInt64}},
		{ratelimit.UpTo(math.MaxInt64), ratelimit.OptionValue{Sized: true, Units: math.MaxInt64, UpTo: true}},
		{ratelimit.AtRate(r), ratelimit.OptionValue{Rate: r, Rated: true}},
		{ratelimit.Option{}, ratelimit.OptionValue{}},
	} {
		require.Equal(t, c.want, c.o.Value())
	}
}
