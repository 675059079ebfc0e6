package ratelimit

import (
	"context"
	"encoding/hex"
	"math"
	"sync/atomic"
	"time"

	"github.com/pgrl/pgrl/internal/denywire"
)

// DenyChannel is the NOTIFY channel on which limiters with
// Config.ShareDenials send their denials. Its payload is a JSON object:
// {"v": 1, "schema", "limiter", "alg", "window_us", "limit", "burst",
// "marks": [{"key", "cost", "until_us", "reset_us", "used"}]}, where
// "schema" is the schema of pgrl's tables, "key" the hex of a stored key
// (StoredKey with HashedKeys: a digest) and "until_us" the deadline on
// the database's clock, in microseconds since the Unix epoch.
const DenyChannel = "pgrl_deny"

// Bounds of the sending of denials.
const (
	// shareQueue is the most marks a limiter holds for sending; more are
	// dropped.
	shareQueue = 256
	// shareInterval is the least time between two statements of one
	// limiter's sender while marks keep coming.
	shareInterval = 20 * time.Millisecond
	// shareTimeout bounds one sending statement when DatabaseOptions.Timeout does
	// not.
	shareTimeout = 5 * time.Second
)

// ShareStats counts what a Limiter has done with shared denials since it was made.
type ShareStats struct {
	// Sent is the marks sent, in Notifies statements.
	Sent, Notifies uint64
	// Dropped is the marks not sent because the queue was full, Failed
	// those whose statement failed (each failure streak is logged once).
	Dropped, Failed uint64
	// Received is the marks AddDenial put in the deny cache; Refused
	// those it refused (another rate, expired, out of range, cache off).
	Received, Refused uint64
	// Answered is the checks answered from a received mark.
	Answered uint64
}

// SharedDenial is a denial that another process learnt from PostgreSQL
// (see Config.ShareDenials), to put in this process's deny cache with
// Limiter.AddDenial. package policy's Listener builds them from the
// notifications; other transports can too.
type SharedDenial struct {
	// Key is the stored key (StoredKey with HashedKeys, 16 bytes).
	Key []byte
	// Algorithm and Rate are those of the limiter that PostgreSQL denied
	// for (Rate.Burst 0 means Limit): the mark applies only to a limiter
	// of the same algorithm at the same rate, so that a denial under an
	// old limit never outlives a change of it.
	Algorithm Algorithm
	Rate      Rate
	// Cost is the denied check's cost: the mark answers checks costing at
	// least Cost.
	Cost int64
	// Used is Decision.Used when PostgreSQL denied.
	Used int64
	// Until is the local instant (read from time.Now, so with its
	// monotonic reading) until which PostgreSQL denies the key, converted
	// so that it is no later than PostgreSQL's deadline. ResetAt is
	// Decision.ResetAt on the same local clock (Until when earlier).
	Until, ResetAt time.Time
}

// denyShare is a limiter's state for shared denials.
type denyShare struct {
	send *denySender               // nil when not sending
	recv atomic.Pointer[denyCache] // received marks by stored key; nil until the first

	received, refused, answered atomic.Uint64
}

// denySender sends one limiter's denials.
type denySender struct {
	sent    *denyCache // marks sent, by stored key, until their local deadline
	queue   chan denywire.Mark
	running atomic.Bool
	failing atomic.Bool

	marks, notifies, dropped, failed atomic.Uint64
}

// checkShare refuses a ShareDenials configuration that cannot work. It
// runs before defaults are filled in.
func (c Config) checkShare() error {
	if !c.ShareDenials {
		return nil
	}
	switch {
	case c.DenyCacheSize < 0 && !c.Penalty: // Penalty turns it off by default (and sends nothing)
		return invalid(ErrInvalidOption, "ShareDenials for %q needs the deny cache, which DenyCacheSize %d turns off; set DenyCacheSize to 0 (the default) or more, or turn ShareDenials off", c.Name, c.DenyCacheSize)
	case c.Spread > 1:
		return invalid(ErrInvalidOption, "ShareDenials for %q cannot share the denials of a limit spread over %d rows (a row's denial says nothing of the others); use Spread 1, or turn ShareDenials off", c.Name, c.Spread)
	case c.KeyMode == ReadableKeys:
		return invalid(ErrInvalidOption, "ShareDenials for %q would send readable stored keys, which are the callers' keys, in notifications any role of the database can LISTEN to; use HashedKeys (the default), or turn ShareDenials off", c.Name)
	}
	return nil
}

// initShare sets up sharing for a new limiter.
func (l *Limiter) initShare() error {
	if !l.cfg.ShareDenials || l.deny == nil {
		return nil // Penalty turned the cache off: nothing to share
	}
	if singleConn(l.st.db) {
		return invalid(ErrInvalidOption, "ShareDenials for %q sends from another goroutine, which a *pgx.Conn or pgx.Tx cannot serve beside the caller; give the limiter a *pgxpool.Pool, or turn ShareDenials off", l.cfg.Name)
	}
	l.share.send = &denySender{
		sent:  newDenyCache(l.cfg.DenyCacheSize),
		queue: make(chan denywire.Mark, shareQueue),
	}
	return nil
}

// ShareStats returns the limiter's counts of shared denials (those of its
// per-call rates, WithRate, are their own).
func (l *Limiter) ShareStats() ShareStats {
	s := ShareStats{
		Received: l.share.received.Load(), Refused: l.share.refused.Load(), Answered: l.share.answered.Load(),
	}
	if snd := l.share.send; snd != nil {
		s.Sent, s.Notifies = snd.marks.Load(), snd.notifies.Load()
		s.Dropped, s.Failed = snd.dropped.Load(), snd.failed.Load()
	}
	return s
}

// shareDenial queues d, PostgreSQL's denial of a check of key costing cost
// sent at the local instant sent, for the other processes, when
// Config.ShareDenials asks for it. It never blocks.
func (l *Limiter) shareDenial(key string, cost int64, d Decision, sent time.Time) {
	s := l.share.send
	if s == nil || d.Allowed || d.Store != StorePostgres || d.RetryAfter < l.st.opts.ShareMinRetryAfter ||
		l.st.opts.Now != nil || d.Now.IsZero() || cost <= 0 {
		return
	}
	sk := string(l.key(key))
	if !s.sent.claim(sk, cost, sent.Add(d.RetryAfter), sent) {
		return // already sent, and still running
	}
	m := denywire.Mark{
		Key:     hex.EncodeToString([]byte(sk)),
		Cost:    cost,
		UntilUs: d.Now.Add(d.RetryAfter).UnixMicro(),
		ResetUs: max(d.ResetAt.UnixMicro(), 0),
		Used:    max(d.Used, 0),
	}
	select {
	case s.queue <- m:
	default:
		s.dropped.Add(1)
		return
	}
	if s.running.CompareAndSwap(false, true) {
		go l.drainShared()
	}
}

// claim records that a mark for key costing cost runs until until, and
// reports whether it must be sent: false when a running mark for a cost no
// larger was already claimed.
func (c *denyCache) claim(key string, cost int64, until, now time.Time) bool {
	k := lookupKey(key)
	sh := c.keys.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if node := sh.get(k); node != nil {
		if old := node.val; now.Before(old.until) && old.cost <= cost {
			return false
		}
		node.val = denyEntry{cost: cost, until: until}
		sh.touch(node)
		return true
	}
	for range sweepPerCall {
		tail := sh.tail
		if tail == nil || now.Before(tail.val.until) {
			break
		}
		sh.remove(tail)
	}
	sh.insert(ownedKey(key, k)).val = denyEntry{cost: cost, until: until}
	return true
}

// drainShared sends the queued marks, one statement at a time and at most
// one every shareInterval, until the queue is empty.
func (l *Limiter) drainShared() {
	s := l.share.send
	for {
		var marks []denywire.Mark
	take:
		for len(marks) < shareQueue {
			select {
			case m := <-s.queue:
				marks = append(marks, m)
			default:
				break take
			}
		}
		if len(marks) == 0 {
			s.running.Store(false)
			// A mark queued after the queue looked empty, by a sender that
			// saw running still true, is sent by whoever wins this.
			if len(s.queue) == 0 || !s.running.CompareAndSwap(false, true) {
				return
			}
			continue
		}
		start := time.Now()
		l.notifyShared(marks)
		if wait := shareInterval - time.Since(start); wait > 0 {
			time.Sleep(wait)
		}
	}
}

// notifySQL sends every body in $1 on DenyChannel in one statement (one
// transaction, whose commit delivers them), with the schema of pgrl's
// tables added.
const notifySQL = `SELECT count(pg_catalog.pg_notify('` + DenyChannel + `',
         (pg_catalog.jsonb_build_object('schema', s.schema) || b::jsonb)::text))
  FROM pg_catalog.unnest($1::text[]) AS b,
       (SELECT coalesce((SELECT n.nspname::text
                           FROM pg_catalog.pg_class AS c
                           JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                          WHERE c.oid = pg_catalog.to_regclass('pgrl_fixed_window')), '') AS schema) AS s`

// notifyShared sends marks in one statement.
func (l *Limiter) notifyShared(marks []denywire.Mark) {
	s := l.share.send
	bodies, skipped := denywire.Encode(denywire.Payload{
		Limiter: l.name, Algorithm: string(l.cfg.Algorithm), WindowUs: l.windowUs,
		Limit: l.cfg.Limit, Burst: l.cfg.Burst, Marks: marks,
	})
	s.failed.Add(uint64(skipped))
	if len(bodies) == 0 {
		return
	}
	timeout := shareTimeout
	if l.st.opts.Timeout > 0 {
		timeout = l.st.opts.Timeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	n := uint64(len(marks) - skipped)
	if _, err := l.st.db.Exec(ctx, notifySQL, bodies); err != nil {
		s.failed.Add(n)
		if s.failing.CompareAndSwap(false, true) {
			l.st.opts.Logger.Warn("pgrl: cannot share denials with the other processes; they keep asking PostgreSQL (logged once until sending works again)",
				"limiter", l.cfg.Name, "error", err)
		}
		return
	}
	s.failing.Store(false)
	s.notifies.Add(1)
	s.marks.Add(n)
}

// AddDenial puts a denial learnt from another process into this limiter's
// deny cache, keyed by stored key: until d.Until, this process answers
// checks of that key costing d.Cost or more with Store StoreDenyCache,
// without a round trip. It reports whether the mark was kept. It is
// refused when it does not apply here: another algorithm, a rate that is
// neither the limiter's nor one of its per-call rates already in use
// (WithRate), a deadline already past or longer than the rate's longest
// denial, a cost beyond the limit, a key that is not a hashed stored key,
// the deny cache off, Spread above 1, or a Database with
// DatabaseOptions.Now set. It never blocks on anything but the cache's
// own short locks, and the cache's size
// (Config.DenyCacheSize) bounds what marks can hold. Once a limiter holds
// a received mark, each of its checks also computes the key's stored form
// (a SHA-256) to look it up.
func (l *Limiter) AddDenial(d SharedDenial) bool {
	target := l
	if d.Rate.Burst == 0 {
		d.Rate.Burst = d.Rate.Limit
	}
	if d.Rate != l.Rate() {
		l.rates.mu.Lock()
		target = l.rates.m[d.Rate]
		l.rates.mu.Unlock()
		if target == nil {
			l.share.refused.Add(1)
			return false
		}
	}
	if !target.addDenial(d, time.Now()) {
		target.share.refused.Add(1)
		return false
	}
	target.share.received.Add(1)
	return true
}

// addDenial checks d against this limiter and keeps it.
func (l *Limiter) addDenial(d SharedDenial, now time.Time) bool {
	if l.deny == nil || l.shards != nil || l.st.opts.Now != nil || l.cfg.KeyMode != HashedKeys ||
		d.Algorithm != l.cfg.Algorithm || len(d.Key) != digestSize ||
		d.Cost <= 0 || d.Cost > l.cfg.capacity() || d.Used < 0 ||
		!now.Before(d.Until) || d.Until.Sub(now) > l.longestDenial() {
		return false
	}
	resetAt := d.ResetAt
	if resetAt.Before(d.Until) {
		resetAt = d.Until
	}
	recv := l.share.recv.Load()
	if recv == nil {
		l.share.recv.CompareAndSwap(nil, newDenyCache(l.cfg.DenyCacheSize))
		recv = l.share.recv.Load()
	}
	recv.putEntry(string(d.Key), denyEntry{
		cost: d.Cost, limit: l.cfg.capacity(), used: d.Used, until: d.Until, resetAt: resetAt,
	}, now)
	return true
}

// longestDenial is the longest RetryAfter PostgreSQL can give this
// limiter's checks: a fixed window's end; two windows for the sliding
// window, whose counts weigh in the next one; for the token bucket, the
// refill of a debt of Burst plus a cost of Burst.
func (l *Limiter) longestDenial() time.Duration {
	switch l.cfg.Algorithm {
	case FixedWindow:
		return l.cfg.Window
	case SlidingWindow:
		return 2 * l.cfg.Window
	}
	us := mulDiv(l.cfg.Window.Microseconds(), min(2*l.cfg.Burst, math.MaxInt64/2), l.cfg.Limit)
	return usToDuration(float64(us) + 1)
}

// sharedDenied answers a check of key costing cost at the local instant
// now from a received mark, if one is running.
func (l *Limiter) sharedDenied(key string, cost int64, now time.Time) (Decision, bool) {
	recv := l.share.recv.Load()
	if recv == nil {
		return Decision{}, false
	}
	d, ok := recv.get(string(l.key(key)), cost, now)
	if !ok {
		return Decision{}, false
	}
	l.share.answered.Add(1)
	d.Reason = "denied by PostgreSQL until a known instant, as another process learnt; answered from the local deny cache"
	return d, true
}

// forgetShared drops the received mark of key, for a Reset.
func (l *Limiter) forgetShared(key string) {
	if recv := l.share.recv.Load(); recv != nil {
		recv.forget(string(l.key(key)))
	}
}
