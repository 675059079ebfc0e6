package policy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cache holds every policy of one schema and its overrides in process
// memory, so that a check reads them without a round trip. Reload and
// ReloadPolicy refresh it; a Listener calls them on every change. Readers
// never wait for a reload: they see the previous contents until the new
// ones are complete. A Cache is safe for concurrent use.
type Cache struct {
	db     DB
	mu     sync.Mutex // serialises reloads, so that a later one always wins
	snap   atomic.Pointer[snapshot]
	schema atomic.Pointer[string]
	// listeners counts the running Listeners that keep the cache current.
	listeners atomic.Int32
}

// snapshot is the cache's contents at one reload.
type snapshot struct {
	policies map[string]*entry
	loadedAt time.Time
}

// entry is one policy with its overrides, by stored key.
type entry struct {
	policy    Policy
	overrides map[string]Override
}

// NewCache returns an empty cache of the policies in db (the schema on
// db's search_path). Call Reload before use, or let NewLimiter and Watch
// load it.
func NewCache(db DB) *Cache {
	c := &Cache{db: db}
	c.snap.Store(&snapshot{policies: map[string]*entry{}})
	return c
}

// LoadedAt is when the last full Reload completed; zero before the first.
func (c *Cache) LoadedAt() time.Time { return c.snap.Load().loadedAt }

// Schema is the schema the policy tables were found in at the last Reload
// ("" before the first): a Listener applies the notifications of this
// schema only.
func (c *Cache) Schema() string {
	if s := c.schema.Load(); s != nil {
		return *s
	}
	return ""
}

// Policy returns the cached policy named name.
func (c *Cache) Policy(name string) (Policy, bool) {
	e, ok := c.snap.Load().policies[name]
	if !ok {
		return Policy{}, false
	}
	return e.policy, true
}

// Policies returns every cached policy, in no order.
func (c *Cache) Policies() []Policy {
	s := c.snap.Load()
	out := make([]Policy, 0, len(s.policies))
	for _, e := range s.policies {
		out = append(out, e.policy)
	}
	return out
}

// watched reports whether a Listener keeps the cache current.
func (c *Cache) watched() bool { return c.listeners.Load() > 0 }

// lookup returns the cached entry of name, or nil.
func (c *Cache) lookup(name string) *entry { return c.snap.Load().policies[name] }

const schemaQuery = `SELECT n.nspname::text FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = to_regclass('pgrl_policy')`

// Reload reads every policy and override, in one snapshot of the
// database, and replaces the cache's contents. On failure the contents stay
// as they were.
func (c *Cache) Reload(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var schema string
	err := c.db.QueryRow(ctx, schemaQuery).Scan(&schema)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && schema == "") {
		return explainRead(ctx, c.db, fmt.Errorf("%w: no table pgrl_policy on the search_path; run `rl-migrate up` (migration 7), and set search_path to pgrl's schema", ErrNotMigrated))
	}
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	m, err := load(ctx, c.db, "", nil)
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	c.schema.Store(&schema)
	c.snap.Store(&snapshot{policies: m, loadedAt: time.Now()})
	return nil
}

// ReloadPolicy reads one policy and its overrides again, and replaces (or,
// when it no longer exists, removes) it in the cache.
func (c *Cache) ReloadPolicy(ctx context.Context, name string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	m, err := load(ctx, c.db, name, nil)
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	old := c.snap.Load()
	next := &snapshot{policies: make(map[string]*entry, len(old.policies)+1), loadedAt: old.loadedAt}
	for k, v := range old.policies {
		next.policies[k] = v
	}
	delete(next.policies, name)
	if e, ok := m[name]; ok {
		next.policies[name] = e
	}
	c.snap.Store(next)
	return nil
}

// refreshKey reads the policy named name and the override of the stored
// key sk again, unless the cached entry is no longer seen (another check
// has refreshed it meanwhile: a change seen by many checks at once costs one
// query). The policy's other overrides stay as they are. A policy that no
// longer exists is removed.
func (c *Cache) refreshKey(ctx context.Context, name string, sk []byte, seen *entry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.snap.Load()
	e := old.policies[name]
	if e != seen {
		return nil
	}
	m, err := load(ctx, c.db, name, sk)
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	next := &snapshot{policies: make(map[string]*entry, len(old.policies)), loadedAt: old.loadedAt}
	for k, v := range old.policies {
		next.policies[k] = v
	}
	delete(next.policies, name)
	if fresh, ok := m[name]; ok {
		ne := &entry{policy: fresh.policy, overrides: make(map[string]Override, len(e.overrides)+1)}
		for k, v := range e.overrides {
			ne.overrides[k] = v
		}
		delete(ne.overrides, string(sk))
		for k, v := range fresh.overrides {
			ne.overrides[k] = v
		}
		next.policies[name] = ne
	}
	c.snap.Store(next)
	return nil
}

// load reads the policy named name (every policy when name is "") with
// its overrides (only that of the stored key sk, when sk is not nil) in
// one statement, hence one snapshot. Expired overrides are left out.
func load(ctx context.Context, db DB, name string, sk []byte) (map[string]*entry, error) {
	rows, err := db.Query(ctx, `
SELECT p.name, p.algorithm, p."limit", `+windowUS(`p."window"`)+`, coalesce(p.burst, 0), p.penalty, p.key_mode,
       coalesce(p.description, ''), `+instantUS("p.created_at")+`, `+instantUS("p.updated_at")+`,
       o.policy, o.key, coalesce(o."limit", 0), `+windowUS(`o."window"`)+`, coalesce(o.burst, 0),
       `+instantUS("o.expires_at")+`, coalesce(o.note, ''), `+instantUS("o.created_at")+`, `+instantUS("o.updated_at")+`
  FROM pgrl_policy AS p
  LEFT JOIN pgrl_policy_override AS o
    ON o.policy = p.name AND (o.expires_at IS NULL OR o.expires_at > now())
   AND ($2::bytea IS NULL OR o.key = $2)
 WHERE $1 = '' OR p.name = $1`, name, sk)
	if err != nil {
		return nil, mapErr(err)
	}
	defer rows.Close()
	m := map[string]*entry{}
	for rows.Next() {
		var p Policy
		var o Override
		pdest, pdone := policyFields(&p)
		odest, odone := overrideFields(&o)
		if err := rows.Scan(append(pdest, odest...)...); err != nil {
			return nil, mapErr(err)
		}
		pdone()
		e := m[p.Name]
		if e == nil {
			e = &entry{policy: p, overrides: map[string]Override{}}
			m[p.Name] = e
		}
		if odone() {
			e.overrides[string(o.Key)] = o
		}
	}
	if err := rows.Err(); err != nil {
		return nil, mapErr(err)
	}
	return m, nil
}

// ReloadOverrides reads the overrides of the given stored keys of one
// policy again and replaces (or, when gone or expired, removes) them in the
// cache, leaving the policy's other overrides as they are: what a Listener
// does for a notification that names a key. When the policy itself is not
// in the cache it is loaded whole.
func (c *Cache) ReloadOverrides(ctx context.Context, name string, keys [][]byte) error {
	if c.lookup(name) == nil {
		return c.ReloadPolicy(ctx, name)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	rows, err := c.db.Query(ctx, `SELECT `+overrideColumns+` FROM pgrl_policy_override
 WHERE policy = $1 AND key = ANY($2) AND (expires_at IS NULL OR expires_at > now())`, name, keys)
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	found, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Override, error) { return scanOverride(r) })
	if err != nil {
		return explainRead(ctx, c.db, err)
	}
	old := c.snap.Load()
	e := old.policies[name]
	if e == nil {
		return nil // removed meanwhile, and its overrides with it
	}
	ne := &entry{policy: e.policy, overrides: make(map[string]Override, len(e.overrides)+len(found))}
	for k, v := range e.overrides {
		ne.overrides[k] = v
	}
	for _, k := range keys {
		delete(ne.overrides, string(k))
	}
	for _, o := range found {
		ne.overrides[string(o.Key)] = o
	}
	next := &snapshot{policies: make(map[string]*entry, len(old.policies)), loadedAt: old.loadedAt}
	for k, v := range old.policies {
		next.policies[k] = v
	}
	next.policies[name] = ne
	c.snap.Store(next)
	return nil
}

// Size reports how many policies, and overrides in force when loaded, the
// cache holds.
func (c *Cache) Size() (policies, overrides int) {
	s := c.snap.Load()
	for _, e := range s.policies {
		overrides += len(e.overrides)
	}
	return len(s.policies), overrides
}
