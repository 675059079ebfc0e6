package policy_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// Under readable keys, an override whose stored key holds more than
// ratelimit.MaxReadableKeyBytes after "name:" could never apply (every check
// of that key is ErrKeyTooLong): SetOverride, Policy.CheckStoredKey and the
// table refuse it, with the longest policy name. The longest key a check
// takes is accepted, by Go and by plain SQL, and its override applies.
func TestReadableOverrideKeyLength(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	name := "r" + strings.Repeat("n", 127) // the longest name the table takes
	p, err := policy.Set(ctx, pool, policy.Policy{Name: name, Limit: 2, Window: time.Hour, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)
	longest := strings.Repeat("k", ratelimit.MaxReadableKeyBytes)
	tooLong := longest + "k"

	// The limiter itself refuses the longer key: the override would be dead.
	lim, err := newLimiter(ctx, pool, name, policy.Options{})
	require.NoError(t, err)
	_, err = lim.Allow(ctx, tooLong)
	require.ErrorIs(t, err, ratelimit.ErrKeyTooLong)

	require.ErrorIs(t, p.CheckStoredKey(p.StoredKey(tooLong)), ratelimit.ErrKeyTooLong)
	require.NoError(t, p.CheckStoredKey(p.StoredKey(longest)))
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: name, Key: p.StoredKey(tooLong), Limit: 5})
	require.ErrorIs(t, err, policy.ErrInvalid)
	require.ErrorIs(t, err, ratelimit.ErrKeyTooLong)
	require.ErrorContains(t, err, "would never apply")

	for _, sql := range []string{
		`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ($1, pgrl_policy_key($1, $2), 5)`,
		`INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ($1, pgrl_stored_key($1, $2, true), 5)`,
	} {
		_, err = pool.Exec(ctx, sql, name, tooLong)
		pgErr := requireConstraint(t, err, "pgrl_policy_override_key_length_check")
		require.Contains(t, pgErr.Message, "2049 bytes")
		require.Contains(t, pgErr.Message, "would never apply")
	}
	os, err := policy.ListOverrides(ctx, pool, name)
	require.NoError(t, err)
	require.Empty(t, os, "nothing was written")

	// The longest key that can match: by SQL for one key, by SetOverride for
	// another; an UPDATE that makes the first one longer is refused.
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ($1, pgrl_policy_key($1, $2), 5)`,
		name, longest)
	require.NoError(t, err)
	other := strings.Repeat("o", ratelimit.MaxReadableKeyBytes)
	_, err = policy.SetOverride(ctx, pool, policy.Override{Policy: name, Key: p.StoredKey(other), Limit: 4})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE pgrl_policy_override SET key = key || 'x'::bytea WHERE key = pgrl_policy_key(policy, $1)`, longest)
	requireConstraint(t, err, "pgrl_policy_override_key_length_check")

	lim, err = newLimiter(ctx, pool, name, policy.Options{})
	require.NoError(t, err)
	for key, limit := range map[string]int64{longest: 5, other: 4} {
		for i := int64(1); i <= limit+1; i++ {
			d, err := lim.Allow(ctx, key)
			require.NoError(t, err)
			require.Equal(t, i <= limit, d.Allowed, "check %d under the override's limit of %d", i, limit)
			require.Equal(t, limit, d.Limit)
		}
	}
}
