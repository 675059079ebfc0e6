package policy_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestPolicyLimiterGrants: a policy's limiter in shadow mode reports a
// denial as granting nothing, whether its checks read the policy in their
// statement or from the cache (and are coalesced), for every algorithm; and
// the limiter For a key takes a partial grant's ask as a ceiling.
func TestPolicyLimiterGrants(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, alg := range ratelimit.Algorithms {
		for _, fromCache := range []bool{false, true} {
			name := fmt.Sprintf("shadow-%s-%v", alg, fromCache)
			_, err := policy.Set(ctx, pool, policy.Policy{Name: name, Algorithm: alg, Limit: 5, Window: time.Hour})
			require.NoError(t, err)
			lim, err := newLimiter(ctx, pool, name, policy.Options{FromCache: fromCache,
				Config: ratelimit.Config{Shadow: true},
				Database: testkit.NewDatabase(t, pool, ratelimit.DatabaseOptions{Logger: quiet, Timeout: time.Minute,
					Now: testkit.Pinned(time.Date(2031, 1, 1, 0, 10, 0, 0, time.UTC))})})
			require.NoError(t, err)
			d, err := lim.Allow(ctx, "k", ratelimit.Cost(5))
			require.NoError(t, err)
			require.Equal(t, int64(5), d.Granted, name)
			for range 2 {
				d, err = lim.Allow(ctx, "k", ratelimit.Cost(2))
				require.NoError(t, err)
				require.True(t, d.Allowed, name)
				require.True(t, d.ShadowDenied, name)
				require.Zero(t, d.Granted, "%s: the limit granted nothing", name)
			}
			l, err := lim.For("k")
			require.NoError(t, err)
			d, err = l.Allow(ctx, "k", ratelimit.UpTo(4))
			require.NoError(t, err)
			require.True(t, d.ShadowDenied, name)
			require.Zero(t, d.Granted, name)
			d, err = l.Allow(ctx, "fresh", ratelimit.UpTo(math.MaxInt64))
			require.NoError(t, err, "%s: an ask above the limit is a ceiling", name)
			require.Equal(t, int64(5), d.Granted, name)
		}
	}
}
