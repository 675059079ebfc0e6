package ratelimit

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"time"
	"weak"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PoolShareDivisor sets the share of a *pgxpool.Pool that pgrl's checks
// may hold at once: the pool's MaxConns divided by it, rounded up, so half
// of the pool. Every limiter on one pool (and every policy limiter built
// on it) draws from the same share. The rest of the pool stays free for the
// application's own queries, whatever the database does: when it stalls,
// checks that find the share taken wait for a connection no longer than
// their Timeout and are then answered by the failure policy, instead of
// taking every connection of the pool with them.
//
// A connection counts against the share from the moment a check asks the
// pool for one until it is back in the pool, and also while the pool goes
// on opening a connection for a check that stopped waiting for it (pgx's
// pool finishes a connection attempt its caller abandoned; against a
// stalled server that attempt lasts as long as the stall, or as the
// pool's connect_timeout).
const PoolShareDivisor = 2

// pooled is a *pgxpool.Pool seen through its share: the DB every limiter
// on the pool runs its statements on. One exists per pool (sharedPoolFor),
// so that limiters on one pool compare equal in AllowAll and share a
// coalescer.
type pooled struct {
	pool *pgxpool.Pool
	// slots holds a token for every connection taken, or being opened, for
	// a check.
	slots chan struct{}

	mu sync.Mutex
	// abandoned holds when each slot of a check that stopped waiting for
	// its connection was given up: such slots are returned as the pool's
	// count of connections being opened falls.
	abandoned []time.Time
	watching  bool
}

var pooledByPool = struct {
	sync.Mutex
	m map[*pgxpool.Pool]weak.Pointer[pooled]
}{m: map[*pgxpool.Pool]weak.Pointer[pooled]{}}

// sharedPoolFor returns the share of pool, making it if there is none.
func sharedPoolFor(pool *pgxpool.Pool) *pooled {
	pooledByPool.Lock()
	defer pooledByPool.Unlock()
	if p := pooledByPool.m[pool].Value(); p != nil {
		return p
	}
	n := (int(pool.Config().MaxConns) + PoolShareDivisor - 1) / PoolShareDivisor
	p := &pooled{pool: pool, slots: make(chan struct{}, max(1, n))}
	pooledByPool.m[pool] = weak.Make(p)
	runtime.AddCleanup(p, func(pool *pgxpool.Pool) {
		pooledByPool.Lock()
		defer pooledByPool.Unlock()
		if pooledByPool.m[pool].Value() == nil {
			delete(pooledByPool.m, pool)
		}
	}, pool)
	return p
}

// errShareTaken is the cause reported when a check's deadline passed while
// every connection of its share was taken.
var errShareTaken = errors.New("ratelimit: every connection of the pool's share for pgrl's checks is taken (see PoolShareDivisor)")

// acquire takes a slot and a connection, within ctx. Its errors are marked
// unsent: no statement went out.
func (p *pooled) acquire(ctx context.Context) (*pgxpool.Conn, error) {
	select {
	case p.slots <- struct{}{}:
	default:
		select {
		case p.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, mark(errors.Join(ctx.Err(), errShareTaken), unsent)
		}
	}
	c, err := p.pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			// The pool may go on opening a connection for us, or
			// finish pinging the one it had picked.
			p.abandon()
		} else {
			<-p.slots
		}
		return nil, mark(err, unsent)
	}
	return c, nil
}

// release puts c back in the pool and frees its slot. A connection that
// broke (pgx closes one whose statement was abandoned) is taken out of the
// pool and closed here, its slot kept until it is gone: the pool would
// count it as in use while closing it in the background.
func (p *pooled) release(c *pgxpool.Conn) {
	if !c.Conn().IsClosed() {
		c.Release()
		<-p.slots
		return
	}
	conn := c.Hijack()
	go func() {
		defer func() { <-p.slots }()
		ctx, cancel := context.WithTimeout(context.Background(), closeWait)
		defer cancel()
		_ = conn.Close(ctx)
		select {
		case <-conn.PgConn().CleanupDone():
		case <-ctx.Done():
		}
	}()
}

// closeWait bounds the closing of a broken connection.
const closeWait = 5 * time.Second

// abandonHold is the least time an abandoned slot is kept.
const abandonHold = 200 * time.Millisecond

// abandon keeps a slot until the pool has no more connections being opened
// than there are abandoned slots, and for abandonHold at least (pgx's pool
// finishes the ping of an idle connection after its caller gave up).
func (p *pooled) abandon() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.abandoned = append(p.abandoned, time.Now())
	if p.watching {
		return
	}
	p.watching = true
	go p.watch()
}

// watch returns abandoned slots as the pool finishes opening connections,
// the oldest first.
func (p *pooled) watch() {
	t := time.NewTicker(abandonHold / 2)
	defer t.Stop()
	for now := range t.C {
		opening := int(p.pool.Stat().ConstructingConns())
		p.mu.Lock()
		for len(p.abandoned) > opening && now.Sub(p.abandoned[0]) >= abandonHold {
			p.abandoned = p.abandoned[1:]
			<-p.slots
		}
		if len(p.abandoned) == 0 {
			p.abandoned = nil
			p.watching = false
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
	}
}

// Exec runs sql on a connection of the share.
func (p *pooled) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c, err := p.acquire(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer p.release(c)
	return c.Exec(ctx, sql, args...)
}

// Query runs sql on a connection of the share, which returns to the pool
// when the rows are closed.
func (p *pooled) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c, err := p.acquire(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := c.Query(ctx, sql, args...)
	if err != nil {
		p.release(c)
		return nil, mark(err, beforeRow)
	}
	return &pooledRows{Rows: rows, release: func() { p.release(c) }}, nil
}

// QueryRow runs sql on a connection of the share, which returns to the pool
// when the row is scanned. It reads the row as pgx's QueryRow does, through
// Query, to see whether the row arrived before an error (see
// beforeRow in outcome.go).
func (p *pooled) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := p.Query(ctx, sql, args...)
	if err != nil {
		return errRow{err}
	}
	return pooledRow{rows.(*pooledRows)}
}

// SendBatch sends b on a connection of the share, which returns to the
// pool when the results are closed.
func (p *pooled) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	c, err := p.acquire(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return &pooledBatch{BatchResults: c.SendBatch(ctx, b), release: func() { p.release(c) }}
}

// Begin begins a transaction on a connection of the share, which returns to
// the pool when the transaction ends.
func (p *pooled) Begin(ctx context.Context) (pgx.Tx, error) {
	c, err := p.acquire(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		p.release(c)
		return nil, err
	}
	return &pooledTx{Tx: tx, release: func() { p.release(c) }}, nil
}

// pooledTx is a transaction of the share: its connection returns to the pool
// when it commits or rolls back.
type pooledTx struct {
	pgx.Tx
	once    sync.Once
	release func()
}

func (t *pooledTx) Commit(ctx context.Context) error {
	defer t.once.Do(t.release)
	return t.Tx.Commit(ctx)
}

func (t *pooledTx) Rollback(ctx context.Context) error {
	defer t.once.Do(t.release)
	return t.Tx.Rollback(ctx)
}

// pooledRows are the rows of a statement on the share. An error before the
// first row is marked (see beforeRow in outcome.go).
type pooledRows struct {
	pgx.Rows
	once    sync.Once
	release func()
	seen    bool // a row arrived
}

func (r *pooledRows) Close() {
	r.Rows.Close()
	r.once.Do(r.release)
}

func (r *pooledRows) Next() bool {
	if r.Rows.Next() {
		r.seen = true
		return true
	}
	r.Close()
	return false
}

// Err is the statement's error, marked when no row had arrived.
func (r *pooledRows) Err() error {
	err := r.Rows.Err()
	if err != nil && !r.seen {
		return mark(err, beforeRow)
	}
	return err
}

// pooledRow is the one row of a statement on the share (QueryRow).
type pooledRow struct{ rows *pooledRows }

// Scan reads the first row into dest, as pgx's QueryRow does: ErrNoRows
// when there is none, and the statement's error after reading it to the
// end.
func (r pooledRow) Scan(dest ...any) error {
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

type pooledBatch struct {
	pgx.BatchResults
	once    sync.Once
	release func()
}

func (b *pooledBatch) Close() error {
	err := b.BatchResults.Close()
	b.once.Do(b.release)
	return err
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
