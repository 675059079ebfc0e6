package ratelimit

import "time"

// defaultDenyCacheKeys is the deny cache's cap when none is given.
const defaultDenyCacheKeys = 10_000

// denyCacheShards is how many locks the deny cache spreads its keys over.
const denyCacheShards = 32

// denyCache remembers, per key, that PostgreSQL denied it until a known
// instant, so that this process can answer "denied" again without a round
// trip until then. It never denies beyond what PostgreSQL decided:
//
//   - Only denials made by PostgreSQL (Store StorePostgres) with a positive
//     RetryAfter are kept.
//   - The deadline is local and monotonic: the local instant the check was
//     sent plus RetryAfter. The database decided at or after that instant,
//     so the local deadline comes no later than the one PostgreSQL meant,
//     whatever the two clocks say.
//   - RetryAfter assumes nothing else is counted meanwhile; other checks
//     can only push the real deadline later (except a Reset: call forget).
//   - A denial for cost n says nothing about smaller costs (a token bucket
//     short of 5 tokens may still hold 1), so an entry only answers checks
//     costing at least n. A check costing more waits at least as long, so
//     the entry's deadline is a safe answer for it too.
//
// With Penalty, a denial answered from the cache is not counted in
// PostgreSQL, so a client hammering a denied key is locked out no longer
// than without penalty: the cache can only shorten a lock-out, never
// lengthen it.
//
// Memory is bounded by an LRU cap on keys; expired entries are dropped when
// met and swept a few at a time on put. Keys of up to 64 bytes are stored
// as given, longer ones as a 65-byte digest, as in MemoryLimiter. A
// denyCache is safe for concurrent use.
type denyCache struct {
	keys shardedLRU[denyEntry]
}

// denyEntry is one cached denial, with local, monotonic instants.
type denyEntry struct {
	cost    int64     // the denied check's cost: answers checks costing at least this
	limit   int64     // Decision.Limit
	used    int64     // Decision.Used when PostgreSQL denied
	until   time.Time // denied until this local instant
	resetAt time.Time // Decision.ResetAt, moved to the local clock
}

// newDenyCache returns a deny cache holding at most maxKeys keys (10,000 if
// maxKeys is not positive).
func newDenyCache(maxKeys int) *denyCache {
	if maxKeys <= 0 {
		maxKeys = defaultDenyCacheKeys
	}
	c := &denyCache{}
	c.keys.init(maxKeys, denyCacheShards)
	return c
}

// get returns the cached denial for a check of key costing cost at the
// local instant now (time.Now(), with its monotonic reading), if one is
// still running and covers that cost. The decision has Store
// StoreDenyCache, Used as PostgreSQL reported it, Remaining 0, Now set to now and RetryAfter what is left
// of the denial.
func (c *denyCache) get(key string, cost int64, now time.Time) (Decision, bool) {
	k := lookupKey(key)
	sh := c.keys.shard(k)
	sh.mu.Lock()
	node := sh.get(k)
	if node == nil {
		sh.mu.Unlock()
		return Decision{}, false
	}
	e := node.val
	if !now.Before(e.until) {
		sh.remove(node)
		sh.mu.Unlock()
		return Decision{}, false
	}
	if cost < e.cost {
		sh.mu.Unlock()
		return Decision{}, false
	}
	sh.touch(node)
	sh.mu.Unlock()
	return Decision{
		Allowed:    false,
		Limit:      e.limit,
		Used:       e.used,
		Remaining:  0,
		ResetAt:    e.resetAt,
		RetryAfter: e.until.Sub(now),
		Now:        now,
		Store:      StoreDenyCache,
		Reason:     "denied by PostgreSQL until a known instant; answered from the local deny cache",
	}, true
}

// put records d, PostgreSQL's answer to a check of key costing cost, sent
// at the local instant sent (time.Now() read before the round trip: using
// the instant the answer arrived would stretch the denial by the round
// trip). Allowed decisions, decisions without a positive RetryAfter and
// decisions not made by PostgreSQL are ignored. A running entry for a
// smaller cost is kept, since it answers more checks; one for the same cost
// keeps the later of the two deadlines; otherwise the newer denial replaces
// the older.
func (c *denyCache) put(key string, cost int64, d Decision, sent time.Time) {
	if d.Allowed || d.RetryAfter <= 0 || cost <= 0 || d.Store != StorePostgres {
		return
	}
	c.putEntry(key, denyEntry{
		cost:    cost,
		limit:   d.Limit,
		used:    d.Used,
		until:   sent.Add(d.RetryAfter),
		resetAt: sent.Add(d.ResetAfter()),
	}, sent)
}

// putEntry records e for key at the local instant now, merged with a
// running entry as put describes.
func (c *denyCache) putEntry(key string, e denyEntry, now time.Time) {
	k := lookupKey(key)
	sh := c.keys.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for range sweepPerCall {
		tail := sh.tail
		if tail == nil || now.Before(tail.val.until) {
			break
		}
		sh.remove(tail)
	}
	if node := sh.get(k); node != nil {
		if old := node.val; now.Before(old.until) {
			if old.cost < e.cost {
				return
			}
			if old.cost == e.cost && old.until.After(e.until) {
				// A denial that waited longer in a queue can come back with
				// an earlier deadline than one already known: keep the later.
				e.until, e.resetAt = old.until, old.resetAt
			}
		}
		node.val = e
		sh.touch(node)
		return
	}
	sh.insert(ownedKey(key, k)).val = e
}

// forget drops key's entry, for when the key's counter is reset.
func (c *denyCache) forget(key string) { c.keys.remove(lookupKey(key)) }

// len counts the entries held, expired ones not yet dropped included.
func (c *denyCache) len() int { return c.keys.len() }
