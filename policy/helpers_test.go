package policy_test

import (
	"context"

	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// newLimiter is policy.NewLimiter with the tests' decision timeout
// (testkit.DecisionTimeout) where the options give no Database: the default
// of ratelimit.DefaultTimeout is a bound for production, and a check on a
// busy test machine can outlast it and be answered by the failure policy,
// which a test asserting what PostgreSQL decided must not see.
func newLimiter(ctx context.Context, db ratelimit.DB, name string, o policy.Options) (*policy.Limiter, error) {
	if o.Database == nil {
		var err error
		o.Database, err = ratelimit.NewDatabase(db, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})
		if err != nil {
			return nil, err
		}
	}
	return policy.NewLimiter(ctx, db, name, o)
}
