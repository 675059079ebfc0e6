package ulule

// This file is the store's one statement outside package ratelimit: a
// negative Increment (hits taken back, as Redis's INCRBY takes a negative
// count), which ratelimit does not offer (a cost is at least 1). It is one
// call of pgrl's generated query (package gen) on the row ratelimit counts
// in. When gen's signatures change, this is the file to adapt.

import (
	"context"
	"math"
	"time"

	"github.com/pgrl/pgrl/gen"
)

var queries = gen.New()

// takeBack adds count (negative) units to the key's current window, in the
// row stored under key, and returns the count after it and the window's
// end.
func takeBack(ctx context.Context, db DB, key []byte, count, windowUs int64) (int64, time.Time, error) {
	r, err := queries.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
		// Penalty adds the units whatever the limit; MaxCount only decides
		// the allowed column, which the store does not read.
		Key: key, Cost: count, WindowUs: windowUs, MaxCount: math.MaxInt64, Penalty: true,
	})
	if err != nil {
		return 0, time.Time{}, err
	}
	return r.Count, time.UnixMicro(r.ExpiresAtUs), nil
}
