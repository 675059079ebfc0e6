package cleanup

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Defaults for Opportunistic's zero-valued fields.
const (
	DefaultOpportunisticEvery     = 100
	DefaultOpportunisticBatchSize = 1000
	DefaultOpportunisticTimeout   = 2 * time.Second
)

// Opportunistic cleans up from the request path, for applications that run
// no cron: on one call of Maybe in Every it starts, in a background
// goroutine, one delete-mode batch per table (at most BatchSize rows each),
// under its own Timeout. At most one such cleanup runs at a time per
// Opportunistic value; a call that would start a second one does nothing.
// Maybe never blocks on the database and never fails: errors are logged.
//
// Wiring in a limiter: keep one *Opportunistic next to the pool, and call
// Maybe(ctx, pool) right after a check's statement has returned (never
// before it, so the check's latency is unaffected):
//
//	dec, err := check(ctx)
//	l.cleanup.Maybe(ctx, l.pool) // cleanup is nil unless enabled
//	return dec, err
//
// A nil *Opportunistic is valid and does nothing, so the limiter can call it
// unconditionally. Call Wait when shutting down to let a running cleanup
// finish.
//
// The zero value is ready to use with the defaults.
type Opportunistic struct {
	// Every: on one call in Every, Maybe starts a cleanup. Defaults to
	// DefaultOpportunisticEvery (100).
	Every int
	// BatchSize is the most rows deleted per table per cleanup. Defaults to
	// DefaultOpportunisticBatchSize (1000).
	BatchSize int
	// Timeout bounds a whole background cleanup, including waiting for a
	// pool connection; it is also the statement_timeout. Defaults to
	// DefaultOpportunisticTimeout (2s).
	Timeout time.Duration
	// Logger receives errors and summaries. Defaults to discarding them.
	Logger *slog.Logger

	calls   atomic.Uint64
	running atomic.Bool
	started atomic.Uint64
	wg      sync.WaitGroup
}

// Maybe counts a call and, on one call in Every, starts a background
// cleanup on db unless one is already running. ctx's values are kept but its
// cancellation is not: the cleanup outlives the request that triggered it.
func (o *Opportunistic) Maybe(ctx context.Context, db *pgxpool.Pool) {
	if o == nil || db == nil {
		return
	}
	every := o.Every
	if every <= 0 {
		every = DefaultOpportunisticEvery
	}
	if o.calls.Add(1)%uint64(every) != 0 {
		return
	}
	if !o.running.CompareAndSwap(false, true) {
		return
	}
	o.started.Add(1)
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		defer o.running.Store(false)
		o.runOnce(context.WithoutCancel(ctx), db)
	}()
}

// Started reports how many background cleanups Maybe has started.
func (o *Opportunistic) Started() uint64 {
	if o == nil {
		return 0
	}
	return o.started.Load()
}

// Wait blocks until no background cleanup is running.
func (o *Opportunistic) Wait() {
	if o == nil {
		return
	}
	o.wg.Wait()
}

func (o *Opportunistic) runOnce(ctx context.Context, db *pgxpool.Pool) {
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = DefaultOpportunisticTimeout
	}
	size := o.BatchSize
	if size <= 0 {
		size = DefaultOpportunisticBatchSize
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	res, err := Run(ctx, db, Options{
		Mode:             ModeDelete,
		BatchSize:        size,
		MaxBatches:       1,
		MaxDuration:      timeout,
		LockTimeout:      100 * time.Millisecond,
		StatementTimeout: timeout,
	})
	if err != nil {
		log.Warn("opportunistic cleanup failed", "err", err)
		return
	}
	if res.Skipped {
		return
	}
	log.Debug("opportunistic cleanup",
		"fixed_window_deleted", res.Tables.FixedWindow.Deleted,
		"token_bucket_deleted", res.Tables.TokenBucket.Deleted,
		"sliding_window_deleted", res.Tables.SlidingWindow.Deleted,
		"concurrency_deleted", res.Tables.Concurrency.Deleted,
		"took", res.Duration)
}
