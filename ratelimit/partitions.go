package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgrl/pgrl/internal/sqlops"
)

// maxPartitionsAhead is the most partitions one call of
// pgrl_fixed_window_ensure_partitions makes, and the most EnsurePartitions
// asks for to cover one window (migration.MaxPartitions).
const maxPartitionsAhead = 64

// ErrPartitionWidth: EnsurePartitions was asked to cover a window that spans
// more partitions than are made at once; the partitions are too narrow for
// that window.
var ErrPartitionWidth = errors.New("ratelimit: pgrl_fixed_window's partitions are too narrow for this window")

// EnsurePartitions makes, in the partitioned layout of pgrl_fixed_window,
// the partitions that the given fixed-window limiters' checks need from now
// until one window ahead, so that none of them finds its partition missing
// (ErrNoPartition) before rl-cleanup --partitions next runs. Call it at
// start-up, on a connection of the owner of pgrl's tables (the migration
// role): it runs DDL. Limiters of other algorithms, and the plain layout,
// need nothing; it returns nil for them. Each statement makes at most 64
// partitions in its own transaction. A window that spans more than 63
// partition widths gets ErrPartitionWidth: widen the partitions.
func EnsurePartitions(ctx context.Context, db DB, limiters ...*Limiter) error {
	if db == nil {
		return ErrNilDB
	}
	q := sqlops.New()
	var width time.Duration
	for _, l := range limiters {
		if l == nil || !l.alg.partitioned() {
			continue
		}
		if width == 0 {
			secs, err := q.FixedWindowPartitionSeconds(ctx, db)
			if err != nil {
				return mapErr(err)
			}
			if secs == 0 {
				return nil // plain layout
			}
			width = time.Duration(secs) * time.Second
		}
		n := int64(l.cfg.Window / width)
		if l.cfg.Window%width != 0 {
			n++
		}
		if n+1 > maxPartitionsAhead {
			return fmt.Errorf("%w: limiter %q's window of %s spans %d partitions of %s, more than %d; widen them with `rl-migrate layout partitioned --partition-width %s` or wider",
				ErrPartitionWidth, l.cfg.Name, l.cfg.Window, n+1, width, maxPartitionsAhead,
				((l.cfg.Window/(maxPartitionsAhead-1))/time.Second+1)*time.Second)
		}
		for {
			created, err := q.FixedWindowEnsurePartitionsFrom(ctx, db, sqlops.FixedWindowEnsurePartitionsFromParams{
				AtUs: l.atUs(), AheadUs: l.cfg.Window.Microseconds(),
			})
			if err != nil {
				return mapErr(err)
			}
			if created < maxPartitionsAhead {
				break
			}
		}
	}
	return nil
}
