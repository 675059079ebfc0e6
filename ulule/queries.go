package ulule

// This file is the store's whole dependency on pgrl's generated queries
// (package gen): four fixed-window calls. When gen's signatures change, this
// is the file to adapt.

import (
	"context"
	"time"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/pgerr"
	"github.com/pgrl/pgrl/internal/sqlops"
)

// window is the state of one key's current fixed window, on the database's
// clock.
type window struct {
	count     int64     // units counted in the window
	expiresAt time.Time // end of the window
}

var queries = gen.New()

// incrementWindow adds count units to the key's current window, whatever
// the limit (every hit counts, as in ulule), and returns the window after
// the addition. It is one statement.
func incrementWindow(ctx context.Context, db DB, key []byte, count, windowUs int64) (window, error) {
	r, err := queries.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
		Key: key, Cost: count, WindowUs: windowUs,
		// Penalty counts the units even when the window is over the limit, so
		// max_count only decides the unused allowed column.
		MaxCount: 0, Penalty: true,
	})
	if err != nil && isMissingPartition(err) {
		// Partitioned layout and no partition for this window yet: create
		// it and count again. Nothing was counted by the failed statement.
		if _, perr := sqlops.New().FixedWindowEnsurePartition(ctx, db, sqlops.FixedWindowEnsurePartitionParams{WindowUs: windowUs}); perr != nil {
			return window{}, perr
		}
		r, err = queries.FixedWindowTake(ctx, db, gen.FixedWindowTakeParams{
			Key: key, Cost: count, WindowUs: windowUs, MaxCount: 0, Penalty: true,
		})
	}
	if err != nil {
		return window{}, err
	}
	return window{count: r.Count, expiresAt: time.UnixMicro(r.ExpiresAtUs)}, nil
}

// peekWindow reads the key's current window without counting.
func peekWindow(ctx context.Context, db DB, key []byte, windowUs int64) (window, error) {
	r, err := queries.FixedWindowPeek(ctx, db, gen.FixedWindowPeekParams{Key: key, WindowUs: windowUs})
	if err != nil {
		return window{}, err
	}
	return window{count: r.Count, expiresAt: time.UnixMicro(r.ExpiresAtUs)}, nil
}

// resetKey forgets every window of the key.
func resetKey(ctx context.Context, db DB, key []byte) error {
	_, err := queries.FixedWindowReset(ctx, db, key)
	return err
}

// isMissingPartition reports an insert that no partition accepts.
func isMissingPartition(err error) bool {
	kind, _ := pgerr.Classify(err)
	return kind == pgerr.NoPartition
}
