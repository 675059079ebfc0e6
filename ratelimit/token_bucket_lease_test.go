package ratelimit_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// The lease time the Go side knows is the one migration 000016 counts
// leases with.
func TestTokenBucketLeaseTimeIsTheSQLOne(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	var us int64
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT pgrl_token_bucket_lease_us(0)").Scan(&us))
	require.Equal(t, ratelimit.TokenBucketLeaseTime.Microseconds(), us)
}
