package policy_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// Concurrent Updates of different fields all apply, on a stored policy and
// on one that none of them finds (each creates it, or starts over on the
// one another created). (tests/policy_write_test.go runs the same through
// rl-policy, in several OS processes.)
func TestUpdateConcurrentFields(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(8))
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: time.Second})
	require.NoError(t, err)

	for round := 1; round <= 10; round++ {
		name := fmt.Sprintf("new-%d", round)
		changes := []func(*policy.Policy){
			func(p *policy.Policy) { p.Limit = int64(100 + round) },
			func(p *policy.Policy) { p.Window = time.Duration(round+1) * time.Second },
			func(p *policy.Policy) { p.Burst = int64(1000 + round) },
			func(p *policy.Policy) { p.Penalty = round%2 == 1 },
			func(p *policy.Policy) { p.Description = fmt.Sprintf("round %d", round) },
		}
		var wg sync.WaitGroup
		errs := make(chan error, 2*len(changes))
		for _, target := range []string{"api", name} {
			for _, c := range changes {
				wg.Go(func() {
					_, err := policy.Update(ctx, pool, target, func(p *policy.Policy) error {
						if p.CreatedAt.IsZero() {
							p.Algorithm, p.Limit, p.Window = ratelimit.TokenBucket, 1, time.Second
						}
						c(p)
						return nil
					})
					errs <- err
				})
			}
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		for _, target := range []string{"api", name} {
			p, err := policy.Get(ctx, pool, target)
			require.NoError(t, err)
			require.Equal(t, []any{int64(100 + round), time.Duration(round+1) * time.Second, int64(1000 + round), round%2 == 1, fmt.Sprintf("round %d", round)},
				[]any{p.Limit, p.Window, p.Burst, p.Penalty, p.Description}, "round %d, policy %s", round, target)
		}
	}
}

// Update writes nothing when change fails or the result is invalid, refuses
// a rename, and names what it needs of a DB that cannot begin a
// transaction.
func TestUpdateRefusals(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	before, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 10, Window: time.Minute})
	require.NoError(t, err)

	mine := errors.New("not today")
	_, err = policy.Update(ctx, pool, "api", func(p *policy.Policy) error { p.Limit = 99; return mine })
	require.Same(t, mine, err)
	_, err = policy.Update(ctx, pool, "api", func(p *policy.Policy) error { p.Limit = 0; return nil })
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorIs(t, err, ratelimit.ErrInvalidLimit)
	_, err = policy.Update(ctx, pool, "api", func(p *policy.Policy) error { p.Name = "api2"; return nil })
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorContains(t, err, "keeps its name")
	_, err = policy.Update(ctx, pool, "missing", func(p *policy.Policy) error { return nil })
	require.ErrorIs(t, err, policy.ErrInvalid, "a new policy with no limit is refused")
	_, err = policy.Get(ctx, pool, "missing")
	require.ErrorIs(t, err, policy.ErrNotFound)
	after, err := policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, before, after, "nothing was written")

	for _, f := range []func() error{
		func() error {
			_, err := policy.Update(ctx, noBegin{pool}, "api", func(*policy.Policy) error { return nil })
			return err
		},
		func() error {
			_, err := policy.SetOverride(ctx, noBegin{pool}, policy.Override{Policy: "api", Key: before.StoredKey("k"), Limit: 1})
			return err
		},
	} {
		err := f()
		require.ErrorIs(t, err, policy.ErrInvalid)
		require.ErrorContains(t, err, "pgxpool.Pool")
	}

	// Inside the caller's transaction, Update works on a savepoint.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = policy.Update(ctx, tx, "api", func(p *policy.Policy) error { p.Limit = 0; return nil })
	require.ErrorIs(t, err, policy.ErrInvalid)
	p, err := policy.Update(ctx, tx, "api", func(p *policy.Policy) error { p.Limit = 11; return nil })
	require.NoError(t, err, "the transaction survives a refused Update")
	require.Equal(t, int64(11), p.Limit)
	require.NoError(t, tx.Commit(ctx))
	p, err = policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, int64(11), p.Limit)
}

// noBegin is a DB that cannot begin a transaction.
type noBegin struct{ policy.DB }
