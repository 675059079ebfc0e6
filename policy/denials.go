package policy

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/denywire"
	"github.com/pgrl/pgrl/ratelimit"
)

// DefaultDenialQueue is ListenerOptions.DenialQueue when it is 0.
const DefaultDenialQueue = 1024

// DenialStats counts the shared denials (ratelimit.DenyChannel) a Listener
// has handled. A notification carries the marks of one limiter.
type DenialStats struct {
	// Received is the marks in notifications of the cache's schema.
	Received uint64
	// Applied is the marks a registered limiter kept; Refused those it
	// did not (ratelimit.Limiter.AddDenial says why one is refused), or
	// that arrived before the clocks were compared.
	Applied, Refused uint64
	// Unknown is the marks of a limiter that nobody registered.
	Unknown uint64
	// OtherSchema is the notifications of another schema's installation;
	// Invalid the unreadable ones (bad JSON, bad numbers or hex); Dropped
	// those that arrived faster than they could be handed out.
	OtherSchema, Invalid, Dropped uint64
}

// DenialReceiver is a limiter that takes shared denials:
// *ratelimit.Limiter and *Limiter are.
type DenialReceiver interface {
	// Config names the limiter (Config().Name), read once by Register.
	Config() ratelimit.Config
	// AddDenial puts a mark in the limiter's deny cache.
	AddDenial(ratelimit.SharedDenial) bool
}

// AddDenial puts a denial shared by another process into the deny cache of
// the policy's limiter as it is now (see ratelimit.Limiter.AddDenial). A
// mark made under another version of the policy, or under an override's
// rate that this process has not used yet, is refused: it reports false.
func (l *Limiter) AddDenial(d ratelimit.SharedDenial) bool {
	b, err := l.current()
	if err != nil {
		return false
	}
	return b.lim.AddDenial(d)
}

// ShareStats returns the shared-denial counts of the policy's current
// limiter (ratelimit.Limiter.ShareStats); a change of the policy starts
// them afresh.
func (l *Limiter) ShareStats() ratelimit.ShareStats {
	b, err := l.current()
	if err != nil {
		return ratelimit.ShareStats{}
	}
	return b.lim.ShareStats()
}

// clockSample is one comparison of the database's clock with the local
// one: the database read db in a query sent at the local instant local.
type clockSample struct {
	db, local time.Time
}

// denials is the Listener's topic of shared denials
// (ratelimit.DenyChannel): the connection offers each payload to a queue,
// which a goroutine of its own hands out to the registered limiters.
type denials struct {
	cache   *Cache      // its schema is the one whose marks count
	queue   chan string // payloads waiting for the dispatcher
	mu      sync.Mutex  // serialises Register
	targets atomic.Pointer[map[string][]DenialReceiver]
	clock   atomic.Pointer[clockSample]
	cancel  context.CancelFunc
	done    chan struct{}

	received, applied, refused, unknown, otherSchema, invalid, dropped atomic.Uint64
}

// Register hands the marks of shared denials sent under each limiter's
// name to that limiter, from now on. Several limiters may share a name:
// each gets the marks. Register needs ListenerOptions.Denials; the
// limiters that send need ratelimit.Config.ShareDenials.
func (l *Listener) Register(lims ...DenialReceiver) error {
	if l.den == nil {
		return errors.New("policy: Register needs a listener started with ListenerOptions{Denials: true}; set it in Watch's options")
	}
	for _, r := range lims {
		if r == nil {
			return errors.New("policy: Register got a nil limiter; pass the *ratelimit.Limiter or *policy.Limiter that should receive denials")
		}
	}
	l.den.mu.Lock()
	defer l.den.mu.Unlock()
	next := map[string][]DenialReceiver{}
	if old := l.den.targets.Load(); old != nil {
		for k, v := range *old {
			next[k] = v
		}
	}
	for _, r := range lims {
		name := r.Config().Name
		next[name] = append(next[name][:len(next[name]):len(next[name])], r)
	}
	l.den.targets.Store(&next)
	return nil
}

// newDenials returns the topic, its dispatcher not started.
func newDenials(cache *Cache, queue int) *denials {
	return &denials{cache: cache, queue: make(chan string, queue), cancel: func() {}, done: make(chan struct{})}
}

// start starts the dispatcher; ctx gives it its values only.
func (d *denials) start(ctx context.Context) {
	ctx, d.cancel = context.WithCancel(context.WithoutCancel(ctx))
	go d.dispatch(ctx)
}

// close stops the dispatcher.
func (d *denials) close() {
	d.cancel()
	<-d.done
}

// Channel is ratelimit.DenyChannel.
func (d *denials) Channel() string { return ratelimit.DenyChannel }

// Connected compares the clocks, to convert the deadlines of the marks
// that follow.
func (d *denials) Connected(ctx context.Context, conn *pgx.Conn) error {
	return d.compareClocks(ctx, conn)
}

// Ping compares the clocks again: the query checks the connection too.
func (d *denials) Ping(ctx context.Context, conn *pgx.Conn) error {
	return d.compareClocks(ctx, conn)
}

// Receive is never called: Offer takes every payload.
func (d *denials) Receive(context.Context, []string) error { return nil }

// Offer hands a payload to the dispatcher, dropping it when the queue is
// full: the connection's reader never waits.
func (d *denials) Offer(payload string) {
	select {
	case d.queue <- payload:
	default:
		d.dropped.Add(1)
	}
}

// stats returns the counters.
func (d *denials) stats() DenialStats {
	if d == nil {
		return DenialStats{}
	}
	return DenialStats{
		Received: d.received.Load(), Applied: d.applied.Load(), Refused: d.refused.Load(),
		Unknown: d.unknown.Load(), OtherSchema: d.otherSchema.Load(), Invalid: d.invalid.Load(),
		Dropped: d.dropped.Load(),
	}
}

// dispatch hands out the queued payloads until ctx ends.
func (d *denials) dispatch(ctx context.Context) {
	defer close(d.done)
	for {
		select {
		case <-ctx.Done():
			return
		case p := <-d.queue:
			d.apply(p, time.Now())
		}
	}
}

// apply hands one payload's marks to the limiters registered under
// its limiter's name, at the local instant now.
func (d *denials) apply(payload string, now time.Time) {
	p, marks, err := denywire.Decode(payload)
	if err != nil {
		d.invalid.Add(1)
		return
	}
	if p.Schema != d.cache.Schema() {
		d.otherSchema.Add(1)
		return
	}
	n := uint64(len(marks))
	d.received.Add(n)
	var targets []DenialReceiver
	if m := d.targets.Load(); m != nil {
		targets = (*m)[p.Limiter]
	}
	if len(targets) == 0 {
		d.unknown.Add(n)
		return
	}
	clk := d.clock.Load()
	if clk == nil {
		d.refused.Add(n)
		return
	}
	rate := ratelimit.Rate{Limit: p.Limit, Window: time.Duration(p.WindowUs) * time.Microsecond, Burst: p.Burst}
	for _, m := range marks {
		sd := ratelimit.SharedDenial{
			Key: m.Key, Algorithm: ratelimit.Algorithm(p.Algorithm), Rate: rate, Cost: m.Cost, Used: m.Used,
			Until:   denywire.LocalDeadline(time.UnixMicro(m.UntilUs), clk.db, clk.local, now),
			ResetAt: denywire.LocalDeadline(time.UnixMicro(m.ResetUs), clk.db, clk.local, now),
		}
		kept := false
		for _, t := range targets {
			kept = t.AddDenial(sd) || kept
		}
		if kept {
			d.applied.Add(1)
		} else {
			d.refused.Add(1)
		}
	}
}

// compareClocks reads the database's clock on conn and records it with the
// local instant the query was sent at: what converts the deadlines of
// received marks (denywire.LocalDeadline).
func (d *denials) compareClocks(ctx context.Context, conn *pgx.Conn) error {
	var us int64
	sent := time.Now()
	// As microseconds: a timestamptz in text (the exec and simple-protocol
	// modes) would follow the session's DateStyle and TimeZone.
	if err := conn.QueryRow(ctx, "SELECT "+instantUS("pg_catalog.clock_timestamp()")).Scan(&us); err != nil {
		return err
	}
	d.clock.Store(&clockSample{db: time.UnixMicro(us), local: sent})
	return nil
}
