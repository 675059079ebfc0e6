// Package notifier keeps one LISTEN connection for several topics: each
// topic names a NOTIFY channel and receives that channel's payloads. The
// notifier connects, LISTENs on every topic's channel, lets each topic catch
// up with what it may have missed, delivers notifications, checks a silent
// connection with a query, and after any failure reconnects with
// exponential backoff and jitter. Package policy's Listener runs its policy
// changes and its shared denials as two topics of one notifier.
package notifier

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Topic is one subscriber of a Notifier.
type Topic interface {
	// Channel is the NOTIFY channel the topic listens on.
	Channel() string
	// Connected runs on each new connection, once it LISTENs on every
	// channel and before any notification is delivered: the topic catches
	// up with what it missed while disconnected. An error ends the
	// connection (the notifier reconnects after a backoff).
	Connected(ctx context.Context, conn *pgx.Conn) error
	// Receive gets the payloads of the topic's channel that arrived
	// together, in order. An error ends the connection.
	Receive(ctx context.Context, payloads []string) error
}

// Streamer is a Topic that takes each payload as it arrives, instead of
// in batches through Receive. Offer must not block: the connection is read
// by the goroutine that calls it.
type Streamer interface {
	Offer(payload string)
}

// Pinger is a Topic whose query checks a silent connection: when one
// topic or more is a Pinger, their Ping replaces the notifier's own.
type Pinger interface {
	Ping(ctx context.Context, conn *pgx.Conn) error
}

// Timer is a Topic with work due at some instant: Tick runs once Due's
// instant has passed (due is false when nothing is due). An error from
// Tick ends the connection.
type Timer interface {
	Due() (at time.Time, due bool)
	Tick(ctx context.Context) error
}

// Ender is a Topic told when a connection ends.
type Ender interface {
	Disconnected()
}

// Options configure a Notifier. Every duration must be positive, but
// PingInterval, which is off when negative; New fills in none of them.
type Options struct {
	// MinBackoff is the wait before the first reconnection after a
	// failure; it doubles (with jitter) up to MaxBackoff.
	MinBackoff, MaxBackoff time.Duration
	// PingInterval is how long the connection may stay silent before it is
	// checked with a query answered within PingTimeout.
	PingInterval, PingTimeout time.Duration
	// Name begins each log message, such as "pgrl policy listener".
	Name string
	// Logger receives connection losses.
	Logger *slog.Logger
}

// Batching of notifications.
const (
	// drainWait is how long the notifier waits for a further notification
	// before it delivers those it has.
	drainWait = 2 * time.Millisecond
	// maxBatch caps the notifications taken before they are delivered.
	maxBatch = 10_000
)

// Notifier runs one LISTEN connection for its topics. Its methods are safe
// for concurrent use.
type Notifier struct {
	config *pgx.ConnConfig
	opts   Options
	topics []Topic
	byChan map[string]Topic

	mu      sync.Mutex // guards started and cancel
	started bool
	cancel  context.CancelFunc
	done    chan struct{}

	reconnects atomic.Uint64
	connected  atomic.Bool
	pid        atomic.Uint32
	lastErr    atomic.Pointer[error]
}

// New returns a Notifier for topics on config's connection; Start starts
// it.
func New(config *pgx.ConnConfig, opts Options, topics ...Topic) *Notifier {
	n := &Notifier{config: config, opts: opts, topics: topics, byChan: map[string]Topic{}, cancel: func() {}, done: make(chan struct{})}
	for _, t := range topics {
		n.byChan[t.Channel()] = t
	}
	return n
}

// Start connects and listens in the background, once. ctx gives the
// notifier its values only: Close stops it.
func (n *Notifier) Start(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.started {
		return
	}
	n.started = true
	ctx, n.cancel = context.WithCancel(context.WithoutCancel(ctx))
	go n.run(ctx)
}

// Close stops the notifier and closes its connection. It may be called
// more than once, and before Start.
func (n *Notifier) Close() {
	n.mu.Lock()
	started, cancel := n.started, n.cancel
	n.mu.Unlock()
	cancel()
	if started {
		<-n.done
	}
}

// Connected reports whether the notifier listens, every topic caught up.
func (n *Notifier) Connected() bool { return n.connected.Load() }

// PID is the server process of the connection, 0 when not connected.
func (n *Notifier) PID() uint32 { return n.pid.Load() }

// Reconnects is the connection attempts made after the first.
func (n *Notifier) Reconnects() uint64 { return n.reconnects.Load() }

// LastError is the last error recorded, nil when none.
func (n *Notifier) LastError() error {
	if e := n.lastErr.Load(); e != nil {
		return *e
	}
	return nil
}

// Record records err as the last error, for a topic's failures.
func (n *Notifier) Record(err error) { n.lastErr.Store(&err) }

func (n *Notifier) run(ctx context.Context) {
	defer close(n.done)
	backoff := n.opts.MinBackoff
	for first := true; ; first = false {
		if !first {
			n.reconnects.Add(1)
		}
		healthy := n.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if healthy {
			backoff = n.opts.MinBackoff
		}
		// Full jitter between half and all of the backoff.
		wait := backoff/2 + rand.N(backoff/2+1)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		backoff = min(backoff*2, n.opts.MaxBackoff)
	}
}

// session connects, listens, lets the topics catch up and delivers
// notifications until something fails. It reports whether every topic
// caught up.
func (n *Notifier) session(ctx context.Context) bool {
	conn, err := pgx.ConnectConfig(ctx, n.config)
	if err != nil {
		n.Record(err)
		if ctx.Err() == nil {
			n.opts.Logger.Warn(n.opts.Name+": cannot connect; retrying with backoff", "error", err)
		}
		return false
	}
	defer func() {
		n.connected.Store(false)
		n.pid.Store(0)
		for _, t := range n.topics {
			if e, ok := t.(Ender); ok {
				e.Disconnected()
			}
		}
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	for _, t := range n.topics {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{t.Channel()}.Sanitize()); err != nil {
			n.Record(err)
			return false
		}
	}
	n.pid.Store(conn.PgConn().PID())
	// Listening first, then catching up: what is sent after the LISTEN is
	// delivered, what was sent before is in the catching up.
	for _, t := range n.topics {
		if err := t.Connected(ctx, conn); err != nil {
			n.Record(err)
			return false
		}
	}
	n.connected.Store(true)
	for {
		if ran, err := n.tick(ctx); err != nil {
			return true
		} else if ran {
			continue
		}
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if due, ok := n.wake(); ok {
			wctx, cancel = context.WithDeadline(ctx, due)
		}
		note, err := conn.WaitForNotification(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && wctx.Err() != nil && !conn.IsClosed() {
			// A timer, not a failure: pgx leaves the connection usable
			// when only the wait was cancelled.
			if _, ok := n.timerDue(time.Now()); ok {
				continue // run at the top
			}
			if err := n.ping(ctx, conn); err != nil {
				n.lost(ctx, fmt.Errorf("the listening connection did not answer within %v: %w", n.opts.PingTimeout, err))
				return true
			}
			continue
		}
		if err != nil {
			n.lost(ctx, err)
			return true
		}
		// Take what else has already arrived, so that a burst (a script
		// changing many rows) is delivered at once.
		batches := map[Topic][]string{}
		n.take(note, batches)
		for taken := 1; taken < maxBatch; taken++ {
			dctx, cancel := context.WithTimeout(ctx, drainWait)
			note, err := conn.WaitForNotification(dctx)
			cancel()
			if err != nil {
				if ctx.Err() != nil || dctx.Err() == nil || conn.IsClosed() {
					n.lost(ctx, err)
					return true
				}
				break // nothing more for now
			}
			n.take(note, batches)
		}
		for _, t := range n.topics {
			if b := batches[t]; len(b) > 0 {
				if err := t.Receive(ctx, b); err != nil {
					return true
				}
			}
		}
	}
}

// take offers a notification to its topic if it is a Streamer, or adds
// it to its topic's batch. A notification of no topic's channel is
// dropped (a LISTEN is per channel, so none should come).
func (n *Notifier) take(note *pgconn.Notification, batches map[Topic][]string) {
	t := n.byChan[note.Channel]
	if t == nil {
		return
	}
	if s, ok := t.(Streamer); ok {
		s.Offer(note.Payload)
		return
	}
	batches[t] = append(batches[t], note.Payload)
}

// tick runs the Tick of the first topic whose timer is due, and reports
// whether it ran one.
func (n *Notifier) tick(ctx context.Context) (bool, error) {
	t, ok := n.timerDue(time.Now())
	if !ok {
		return false, nil
	}
	return true, t.Tick(ctx)
}

// timerDue returns a topic whose timer is due at now.
func (n *Notifier) timerDue(now time.Time) (Timer, bool) {
	for _, t := range n.topics {
		if tm, ok := t.(Timer); ok {
			if at, due := tm.Due(); due && !now.Before(at) {
				return tm, true
			}
		}
	}
	return nil, false
}

// wake is when the wait for a notification should stop: the earliest
// timer or the next ping, whichever comes first.
func (n *Notifier) wake() (time.Time, bool) {
	var wake time.Time
	for _, t := range n.topics {
		if tm, ok := t.(Timer); ok {
			if at, due := tm.Due(); due && (wake.IsZero() || at.Before(wake)) {
				wake = at
			}
		}
	}
	if n.opts.PingInterval > 0 {
		if p := time.Now().Add(n.opts.PingInterval); wake.IsZero() || p.Before(wake) {
			wake = p
		}
	}
	return wake, !wake.IsZero()
}

// ping checks a silent connection: with the topics' Ping when some have
// one, else with the notifier's own query.
func (n *Notifier) ping(ctx context.Context, conn *pgx.Conn) error {
	ctx, cancel := context.WithTimeout(ctx, n.opts.PingTimeout)
	defer cancel()
	pinged := false
	for _, t := range n.topics {
		if p, ok := t.(Pinger); ok {
			pinged = true
			if err := p.Ping(ctx, conn); err != nil {
				return err
			}
		}
	}
	if pinged {
		return nil
	}
	return conn.Ping(ctx)
}

// lost records a lost connection.
func (n *Notifier) lost(ctx context.Context, err error) {
	if ctx.Err() == nil {
		n.Record(err)
		n.opts.Logger.Warn(n.opts.Name+": connection lost; reconnecting", "error", err)
	}
}
