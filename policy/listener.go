package policy

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/notifier"
)

// Channel is the NOTIFY channel of migration 000007's triggers. Its payload
// is a JSON object: {"schema", "table", "op", "policy"}; "policy" is null
// after a TRUNCATE.
const Channel = "pgrl_policy"

// Defaults of ListenerOptions.
const (
	DefaultMinBackoff   = 100 * time.Millisecond
	DefaultMaxBackoff   = 10 * time.Second
	DefaultPingInterval = 30 * time.Second
	DefaultPingTimeout  = 5 * time.Second
	// DefaultMinResyncInterval is ListenerOptions.MinResyncInterval's
	// default.
	DefaultMinResyncInterval = time.Second
)

// ListenerOptions configures Watch.
type ListenerOptions struct {
	// MinBackoff is the wait before the first reconnection after a
	// failure; it doubles (with jitter) up to MaxBackoff. Defaults to
	// DefaultMinBackoff and DefaultMaxBackoff.
	MinBackoff, MaxBackoff time.Duration
	// Logger receives connection losses and recoveries. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// ResyncInterval, when positive, also reloads every policy this often
	// while connected: a safety net for a change that reached the tables
	// without its NOTIFY (a trigger disabled for a bulk load, a restore).
	// Each reload reads every policy and override. Defaults to 0 (off).
	ResyncInterval time.Duration
	// MinResyncInterval bounds the full reloads that notifications ask
	// for (a TRUNCATE's, and an unreadable payload's, which any role that
	// can connect may send): at most one per MinResyncInterval, the first
	// at once, and the requests that arrive meanwhile merged into one
	// reload at the end of the interval. Changes of one policy or override
	// are applied at once all the same, except that a policy with more
	// than 1,000 overrides is reloaded whole at most once per interval
	// too (a change of it that comes sooner goes to the next full
	// reload). The reloads of a (re)connection and of ResyncInterval are
	// not delayed. Defaults to
	// DefaultMinResyncInterval; negative turns the bound off.
	MinResyncInterval time.Duration
	// PingInterval is how long the connection may stay silent before the
	// listener checks it with a query (answered within PingTimeout), so
	// that a connection lost without a word (a failover that moved the
	// address, a dropped network path) is noticed in seconds rather than
	// when TCP gives up. Defaults to DefaultPingInterval; negative
	// disables the check.
	PingInterval time.Duration
	// PingTimeout bounds that query, and each connection attempt.
	// Defaults to DefaultPingTimeout.
	PingTimeout time.Duration
	// Denials also LISTENs on ratelimit.DenyChannel and hands the denials
	// other processes share (ratelimit.Config.ShareDenials) to the
	// limiters given to Register, which put them in their deny caches.
	// Marks of another schema, of a limiter not registered, unreadable
	// ones and those that arrive faster than they are handed out are
	// counted in Stats.Denials and ignored; the connection never waits for
	// them. Each connection compares the database's clock with the local
	// one (and again at each PingInterval), to convert the marks'
	// deadlines (see docs/POLICIES.md). Defaults to false.
	Denials bool
	// DenialQueue is how many notifications of shared denials may wait to
	// be handed out before more are dropped. Defaults to
	// DefaultDenialQueue.
	DenialQueue int
}

// Stats counts what a Listener has done since Watch.
type Stats struct {
	// Received is the notifications of the cache's schema; Applied those
	// whose reload succeeded; Ignored those of another schema.
	Received, Applied, Ignored uint64
	// Dropped is the notifications that could not be applied: a reload
	// failed (which closes the connection; the next one resynchronises
	// the whole cache), or a payload was unreadable (which asks for a full
	// reload, bounded by ListenerOptions.MinResyncInterval).
	Dropped uint64
	// Reconnects is the connections made after the first; each may have
	// missed notifications, so each is followed by a full reload.
	Reconnects uint64
	// Resyncs is the full reloads done (the first one included).
	Resyncs uint64
	// ResyncsMerged is the requests for a full reload (a TRUNCATE, an
	// unreadable payload, a change of a large policy too soon after the
	// last) that waited for MinResyncInterval and were answered by a
	// reload done for another.
	ResyncsMerged uint64
	// PolicyReloads is the reloads of one whole policy with its overrides
	// (after a change of the policy's row).
	PolicyReloads uint64
	// Connected reports whether the listener is connected and listening.
	Connected bool
	// LastError is the last connection or reload error, "" when none.
	LastError string
	// Denials counts the shared denials handled, with
	// ListenerOptions.Denials.
	Denials DenialStats
}

// Listener keeps a Cache current: it LISTENs on Channel on a connection of
// its own and reloads the policy named in each notification of the
// cache's schema. After any failure it reconnects with exponential backoff
// and reloads everything, since notifications sent while it was away are
// lost. Checks never wait for it: they read the cache's last complete
// contents. Close turns it off.
//
// The connection must be a direct one (or through PgBouncer in session
// mode): LISTEN needs a session that stays on one server connection, which
// PgBouncer's transaction and statement modes do not give. It holds one
// connection of the server's max_connections for as long as it runs, for
// the policy changes and, with ListenerOptions.Denials, the shared
// denials: each is a topic of one notifier (package internal/notifier).
type Listener struct {
	cache *Cache
	n     *notifier.Notifier
	ch    *changesTopic
	den   *denials // nil without ListenerOptions.Denials
	once  sync.Once
}

// Watch starts a Listener on connString (a URL or keyword/value string
// whose search_path, if it sets one, finds the same schema as the cache's
// database) and returns at once: it connects, LISTENs and reloads the
// cache in the background. WaitSynced waits for that first reload. ctx
// gives the listener its values only: its end does not stop the listener,
// Close does.
func Watch(ctx context.Context, connString string, cache *Cache, opts ListenerOptions) (*Listener, error) {
	if cache == nil {
		return nil, errors.New("policy: Watch needs a Cache; pass the one your limiters use (policy.NewCache)")
	}
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("policy: listener connection string: %w", err)
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = DefaultMinBackoff
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = DefaultMaxBackoff
	}
	if opts.MaxBackoff < opts.MinBackoff {
		opts.MaxBackoff = opts.MinBackoff
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.PingInterval == 0 {
		opts.PingInterval = DefaultPingInterval
	}
	if opts.PingTimeout <= 0 {
		opts.PingTimeout = DefaultPingTimeout
	}
	if opts.MinResyncInterval == 0 {
		opts.MinResyncInterval = DefaultMinResyncInterval
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = opts.PingTimeout
	}
	if opts.DenialQueue < 0 {
		return nil, fmt.Errorf("policy: ListenerOptions.DenialQueue %d; use a positive size, or 0 for %d", opts.DenialQueue, DefaultDenialQueue)
	}
	if opts.DenialQueue == 0 {
		opts.DenialQueue = DefaultDenialQueue
	}
	l := &Listener{cache: cache}
	l.ch = &changesTopic{l: l, cache: cache, opts: opts, synced: make(chan struct{})}
	topics := []notifier.Topic{l.ch}
	if opts.Denials {
		l.den = newDenials(cache, opts.DenialQueue)
		topics = append(topics, l.den)
	}
	cache.listeners.Add(1) // until Close
	l.n = notifier.New(cfg, notifier.Options{
		MinBackoff: opts.MinBackoff, MaxBackoff: opts.MaxBackoff,
		PingInterval: opts.PingInterval, PingTimeout: opts.PingTimeout,
		Name: "pgrl policy listener", Logger: opts.Logger,
	}, topics...)
	if l.den != nil {
		l.den.start(ctx)
	}
	l.n.Start(ctx)
	return l, nil
}

// WaitSynced waits until the listener has listened and loaded the cache
// once, or ctx ends. Then the error wraps ctx's error and the last
// connection or reload error, so errors.Is finds ErrPermission (a missing
// grant, named in the message) or ErrNotMigrated.
func (l *Listener) WaitSynced(ctx context.Context) error {
	select {
	case <-l.ch.synced:
		return nil
	case <-ctx.Done():
		if e := l.n.LastError(); e != nil {
			return fmt.Errorf("policy: listener not synchronised (%w): %w", e, ctx.Err())
		}
		return fmt.Errorf("policy: listener not synchronised: %w", ctx.Err())
	}
}

// PID is the server process of the listener's connection, 0 when not
// connected.
func (l *Listener) PID() uint32 { return l.n.PID() }

// Stats returns the listener's counters.
func (l *Listener) Stats() Stats {
	c := l.ch
	s := Stats{
		Received: c.received.Load(), Applied: c.applied.Load(), Ignored: c.ignored.Load(),
		Dropped: c.dropped.Load(), Reconnects: l.n.Reconnects(), Resyncs: c.resyncs.Load(), ResyncsMerged: c.merged.Load(),
		PolicyReloads: c.policyReloads.Load(),
		Connected:     l.n.Connected(), Denials: l.den.stats(),
	}
	if e := l.n.LastError(); e != nil {
		s.LastError = e.Error()
	}
	return s
}

// Close stops the listener and closes its connection. The cache keeps its
// contents, which nothing refreshes any more.
func (l *Listener) Close() error {
	l.n.Close()
	if l.den != nil {
		l.den.close()
	}
	l.once.Do(func() { l.cache.listeners.Add(-1) })
	return nil
}

// changesTopic is the Listener's topic of policy changes (Channel): it reloads
// the cache when a connection starts and what each notification names
// after that.
type changesTopic struct {
	l      *Listener
	cache  *Cache
	opts   ListenerOptions
	synced chan struct{} // closed by the first reload
	once   sync.Once

	// The state of the full reloads: used by the notifier's goroutine
	// only.
	r          resyncs
	nextResync time.Time

	received, applied, ignored, dropped, resyncs, merged, policyReloads atomic.Uint64
}

// errEnd ends a connection after a failure the topic has already recorded
// and logged.
var errEnd = errors.New("policy: the listener's connection ends after a failed reload")

// Channel is Channel.
func (ct *changesTopic) Channel() string { return Channel }

// Connected reloads the whole cache: a change committed after the LISTEN
// is notified, one committed before is in the reload.
func (ct *changesTopic) Connected(ctx context.Context, _ *pgx.Conn) error {
	if err := ct.cache.Reload(ctx); err != nil {
		if ctx.Err() == nil {
			ct.opts.Logger.Warn("pgrl policy listener: cannot load the policies; retrying with backoff", "error", err)
		}
		return err
	}
	ct.resyncs.Add(1)
	ct.once.Do(func() { close(ct.synced) })
	if n := ct.l.n.Reconnects(); n > 0 {
		ct.opts.Logger.Info("pgrl policy listener: reconnected and reloaded the policies", "reconnects", n)
	}
	// Full reloads asked for by notifications wait for MinResyncInterval
	// after the last one: requests meanwhile are merged into one.
	ct.r = resyncs{last: time.Now(), whole: map[string]time.Time{}}
	ct.nextResync = time.Now().Add(ct.opts.ResyncInterval)
	return nil
}

// Disconnected drops the notifications still waiting for a full reload:
// the next connection's reload covers them.
func (ct *changesTopic) Disconnected() {
	ct.dropped.Add(ct.r.notes)
	ct.r.notes = 0
}

// Due is when the next full reload is due: the periodic one of
// ResyncInterval, or one that notifications asked for.
func (ct *changesTopic) Due() (time.Time, bool) {
	var at time.Time
	if ct.opts.ResyncInterval > 0 {
		at = ct.nextResync
	}
	if ct.r.wanted && (at.IsZero() || ct.r.due.Before(at)) {
		return ct.r.due, true
	}
	return at, !at.IsZero()
}

// Tick does the full reload that is due.
func (ct *changesTopic) Tick(ctx context.Context) error {
	if ct.opts.ResyncInterval > 0 && !time.Now().Before(ct.nextResync) {
		ct.r.wanted = true
		ct.r.due = time.Time{} // the periodic reload is not delayed
	}
	if ct.r.wanted && !time.Now().Before(ct.r.due) {
		if !ct.resync(ctx, &ct.r) {
			return errEnd
		}
		ct.nextResync = time.Now().Add(ct.opts.ResyncInterval)
	}
	return nil
}

// Receive applies a batch of notifications.
func (ct *changesTopic) Receive(ctx context.Context, payloads []string) error {
	if !ct.apply(ctx, payloads, &ct.r) {
		return errEnd
	}
	return nil
}

// resyncs is a session's state of the full reloads that notifications ask
// for.
type resyncs struct {
	wanted bool      // a full reload is asked for
	due    time.Time // not before then
	last   time.Time // the last full reload ended
	asked  uint64    // requests since the last reload
	notes  uint64    // readable notifications it answers (TRUNCATE)
	// whole is when each large policy (more than maxKeys overrides) was
	// last reloaded whole: a notification can name one as often as it
	// likes, and its reload costs nearly a full one.
	whole map[string]time.Time
}

// want records asked requests for a full reload, notes of them readable
// notifications: due at once when the last reload is MinResyncInterval
// old, else at the end of that interval.
func (ct *changesTopic) want(r *resyncs, asked, notes uint64) {
	if !r.wanted {
		r.wanted = true
		r.due = time.Time{}
		if ct.opts.MinResyncInterval > 0 {
			r.due = r.last.Add(ct.opts.MinResyncInterval)
		}
	}
	r.asked += asked
	r.notes += notes
}

// resync reloads everything, answering every request recorded in r. It
// returns false when the session must end.
func (ct *changesTopic) resync(ctx context.Context, r *resyncs) bool {
	if err := ct.cache.Reload(ctx); err != nil {
		return ct.reloadFailed(ctx, err) // r.notes are dropped as the session ends
	}
	ct.resyncs.Add(1)
	ct.applied.Add(r.notes)
	if r.asked > 1 {
		ct.merged.Add(r.asked - 1)
	}
	*r = resyncs{last: time.Now(), whole: r.whole}
	return true
}

// maxKeys is the most changed overrides of one policy reloaded row by row;
// beyond it the policy is reloaded whole.
const maxKeys = 1000

// notice is a notification's payload.
type notice struct {
	Schema string  `json:"schema"`
	Table  string  `json:"table"`
	Op     string  `json:"op"`
	Policy *string `json:"policy"`
	Key    string  `json:"key"`
}

// change is what a batch asks to reload of one policy.
type change struct {
	whole bool     // the policy row changed, or too many keys
	keys  [][]byte // changed overrides, by stored key
	n     uint64   // notifications
}

// apply reloads what a batch of notifications names: per policy the whole
// policy or the overrides named, at once; a TRUNCATE or an unreadable
// payload asks r for a full reload, which the session does when
// MinResyncInterval allows, and so does the whole reload of a large policy
// done less than MinResyncInterval after its last. It returns false when the session must end (a
// reload failed): the next one resynchronises.
func (ct *changesTopic) apply(ctx context.Context, payloads []string, r *resyncs) bool {
	schema := ct.cache.Schema()
	all, unreadable := uint64(0), uint64(0)
	changes := map[string]*change{}
	var order []string
	for _, p := range payloads {
		var n notice
		if err := json.Unmarshal([]byte(p), &n); err != nil {
			// Any role that can connect may send one: a full reload
			// catches up with whatever it stood for, at a bounded rate.
			ct.dropped.Add(1)
			unreadable++
			if len(p) > 200 {
				p = p[:200] + "..."
			}
			ct.l.n.Record(fmt.Errorf("unreadable notification %q: %w", p, err))
			continue
		}
		if n.Schema != schema {
			ct.ignored.Add(1)
			continue
		}
		ct.received.Add(1)
		if n.Policy == nil {
			all++
			continue
		}
		c := changes[*n.Policy]
		if c == nil {
			c = &change{}
			changes[*n.Policy] = c
			order = append(order, *n.Policy)
		}
		c.n++
		k, err := hex.DecodeString(n.Key)
		if n.Key == "" || err != nil || len(c.keys) >= maxKeys {
			c.whole = true
		} else if !c.whole {
			c.keys = append(c.keys, k)
		}
	}
	if unreadable > 0 {
		ct.want(r, unreadable, 0)
	}
	if all > 0 {
		ct.want(r, all, all)
	}
	for i, name := range order {
		c := changes[name]
		var err error
		if c.whole {
			if ct.large(name) && ct.opts.MinResyncInterval > 0 && time.Since(r.whole[name]) < ct.opts.MinResyncInterval {
				// Reloaded whole less than MinResyncInterval ago: a full
				// reload answers this one, at the bounded rate.
				ct.want(r, 1, c.n)
				continue
			}
			err = ct.cache.ReloadPolicy(ctx, name)
			if err == nil {
				ct.policyReloads.Add(1)
				if ct.large(name) {
					r.whole[name] = time.Now()
				} else {
					delete(r.whole, name)
				}
			}
		} else {
			err = ct.cache.ReloadOverrides(ctx, name, c.keys)
		}
		if err != nil {
			for _, rest := range order[i:] {
				ct.dropped.Add(changes[rest].n)
			}
			return ct.reloadFailed(ctx, err)
		}
		ct.applied.Add(c.n)
	}
	return true
}

// large reports whether the cached policy named name has more than
// maxKeys overrides: its whole reload costs about as much as a full one.
func (ct *changesTopic) large(name string) bool {
	e := ct.cache.lookup(name)
	return e != nil && len(e.overrides) > maxKeys
}

func (ct *changesTopic) reloadFailed(ctx context.Context, err error) bool {
	ct.l.n.Record(err)
	if ctx.Err() == nil {
		ct.opts.Logger.Warn("pgrl policy listener: cannot reload after a change; will reconnect and reload everything", "error", err)
	}
	return false
}
