// Package policy keeps rate limits in the database: named policies in table
// pgrl_policy and per-key overrides in pgrl_policy_override (migration
// 000007), so that operations can change a limit with one UPDATE, or with
// rl-policy, and every instance of the application follows within a second.
//
// Set, Update, Get, List and Delete manage policies (Update changes some
// fields under the row's lock, so concurrent writers never lose each other's
// changes); SetOverride, ListOverrides and
// DeleteOverride the overrides of one key; Explain says which limit applies
// to a key and what it has used. NewLimiter builds a limiter from a stored
// policy. By default each check reads the policy and the key's override in
// the one statement that counts (two primary-key lookups joined to the
// counter's upsert: no extra round trip), so a change made by plain SQL is
// obeyed by the next check; the Cache held in memory tells the limiter
// which counter row a key uses, and is read again from the tables when a
// check finds the policy changed. With Options.FromCache, checks use the
// policy and override as last loaded into the Cache instead, and do not
// touch the policy tables. A Listener keeps the Cache current from the
// NOTIFY that every change of either table sends.
//
// Every statement works in each pgx exec mode (the simple protocol and exec
// modes included, for PgBouncer) and reads and passes instants and windows
// as whole microseconds, so no session setting (DateStyle, IntervalStyle,
// TimeZone) changes what it reads.
//
// The tables are described, with plain SQL for a DBA, in docs/POLICIES.md.
package policy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/ratelimit"
)

// DB runs this package's statements: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx (ratelimit.DB).
type DB = ratelimit.DB

// Policy is one row of pgrl_policy: a named limit.
type Policy struct {
	// Name is the limiter's name: it scopes the keys, as
	// ratelimit.Config.Name does. 1 to 128 characters of A-Z a-z 0-9 and
	// _ . : / + -, starting with a letter or digit.
	Name string
	// Algorithm defaults to ratelimit.FixedWindow.
	Algorithm ratelimit.Algorithm
	// Limit, Window and Burst are ratelimit.Config's; Burst 0 means Limit.
	Limit  int64
	Window time.Duration
	Burst  int64
	// Penalty counts denied attempts too (ratelimit.Config.Penalty).
	Penalty bool
	// KeyMode is how keys are stored, in the counters and in the overrides.
	KeyMode ratelimit.KeyMode
	// Description is free text for people, at most 1,000 characters.
	Description string
	// CreatedAt and UpdatedAt are set by the database; Set ignores them.
	CreatedAt, UpdatedAt time.Time
}

// Rate is the policy's own rate.
func (p Policy) Rate() ratelimit.Rate {
	return ratelimit.Rate{Limit: p.Limit, Window: p.Window, Burst: p.Burst}
}

// Config returns base with the policy's name, algorithm, limit, window,
// burst, penalty and key mode, and KeyByWindow set (a stored window can
// change, and counts at two windows must never meet): the configuration a
// limiter of this policy has. Everything else (failure policy, timeout,
// observer, ...) is base's, except that ShareDenials is turned off for a
// readable key mode (its stored keys are the callers' keys).
func (p Policy) Config(base ratelimit.Config) ratelimit.Config {
	base.Name, base.Algorithm, base.Limit, base.Window, base.Burst = p.Name, p.Algorithm, p.Limit, p.Window, p.Burst
	base.Penalty, base.KeyMode = p.Penalty, p.KeyMode
	base.KeyByWindow = true
	if p.KeyMode == ratelimit.ReadableKeys {
		// A readable stored key is the caller's key: never in a NOTIFY.
		base.ShareDenials = false
	}
	return base
}

// StoredKey is key as the policy's counters, and pgrl_policy_override.key,
// store it (ratelimit.StoredKey with the policy's name and key mode; in SQL,
// pgrl_stored_key(name, key, key_mode = 'readable')).
func (p Policy) StoredKey(key string) []byte {
	return ratelimit.StoredKey(p.KeyMode, p.Name, key)
}

// same reports whether p and q describe the same limit.
func (p Policy) same(q Policy) bool {
	return p.Name == q.Name && p.Algorithm == q.Algorithm && p.Limit == q.Limit && p.Window == q.Window &&
		p.Burst == q.Burst && p.Penalty == q.Penalty && p.KeyMode == q.KeyMode
}

// Validate refuses what the table's constraints or ratelimit.Config would.
func (p Policy) Validate() error {
	if !ratelimit.ValidPolicyName(p.Name) {
		return invalid(ratelimit.ErrInvalidName, "%q; %s", p.Name, constraintFix["pgrl_policy_name_check"])
	}
	if p.Algorithm == "" {
		p.Algorithm = ratelimit.DefaultAlgorithm
	}
	if len(p.Description) > 1000 {
		return invalid(nil, "description of %d characters for %q; %s", len(p.Description), p.Name, constraintFix["pgrl_policy_description_check"])
	}
	if p.KeyMode != ratelimit.HashedKeys && p.KeyMode != ratelimit.ReadableKeys {
		return invalid(nil, "key mode %d for %q; use ratelimit.HashedKeys or ratelimit.ReadableKeys", p.KeyMode, p.Name)
	}
	if err := p.Config(ratelimit.Config{}).Validate(); err != nil {
		return invalid(err, "")
	}
	return nil
}

// Override is one row of pgrl_policy_override: another limit, window or
// burst for one key of a policy, until ExpiresAt.
type Override struct {
	// Policy is the policy's name; it must exist.
	Policy string
	// Key is the key in its stored form: Policy.StoredKey(key).
	Key []byte
	// Limit, Window and Burst replace the policy's; 0 inherits it. At
	// least one is set.
	Limit  int64
	Window time.Duration
	Burst  int64
	// ExpiresAt, when not zero, is when the override stops applying.
	ExpiresAt time.Time
	// Note is free text for people (who, why, a ticket), at most 1,000
	// characters. The key is stored hashed by default, so the note is
	// where to say whose key it is.
	Note string
	// CreatedAt and UpdatedAt are set by the database.
	CreatedAt, UpdatedAt time.Time
}

// Applies reports whether the override is in force at now.
func (o Override) Applies(now time.Time) bool {
	return o.ExpiresAt.IsZero() || now.Before(o.ExpiresAt)
}

// Rate is the rate a key of p gets under the override.
func (o Override) Rate(p Policy) ratelimit.Rate {
	r := p.Rate()
	if o.Limit != 0 {
		r.Limit = o.Limit
		if o.Burst == 0 && p.Burst == 0 {
			r.Burst = 0 // the burst follows the limit it defaults to
		}
	}
	if o.Window != 0 {
		r.Window = o.Window
	}
	if o.Burst != 0 {
		r.Burst = o.Burst
	}
	return r
}

// Validate refuses an override that the constraints refuse, or whose rate
// under p ratelimit would refuse.
func (o Override) Validate(p Policy) error {
	if o.Policy != p.Name {
		return invalid(nil, "override of policy %q checked against policy %q", o.Policy, p.Name)
	}
	if len(o.Key) == 0 || len(o.Key) > maxStoredKey {
		return invalid(ratelimit.ErrKeyTooLong, "stored key of %d bytes for %q; %s", len(o.Key), p.Name, constraintFix["pgrl_policy_override_key_check"])
	}
	if err := p.CheckStoredKey(o.Key); err != nil {
		return err
	}
	if o.Limit < 0 || o.Window < 0 || o.Burst < 0 {
		return invalid(nil, "negative limit, window or burst in an override of %q; use 0 to inherit the policy's", p.Name)
	}
	if o.Limit == 0 && o.Window == 0 && o.Burst == 0 {
		return invalid(nil, "override of %q; %s", p.Name, constraintFix["pgrl_policy_override_something_check"])
	}
	if len(o.Note) > 1000 {
		return invalid(nil, "note of %d characters for %q; %s", len(o.Note), p.Name, constraintFix["pgrl_policy_override_note_check"])
	}
	r := o.Rate(p)
	q := p
	q.Limit, q.Window, q.Burst = r.Limit, r.Window, r.Burst
	if err := q.Config(ratelimit.Config{}).Validate(); err != nil {
		return invalid(err, "(the rate this override would give the key)")
	}
	return nil
}

// CheckStoredKey returns ErrInvalid when key cannot be the stored form of
// any key a check accepts under p's key mode (what the table's trigger
// pgrl_policy_override_key_mode_check refuses, migrations 000008 and
// 000009): under hashed keys anything but 16 bytes; under readable keys
// anything that does not start with p's name and ':', and (also
// ratelimit.ErrKeyTooLong) anything holding more than
// ratelimit.MaxReadableKeyBytes after it, since a check refuses a longer
// caller's key. Such a key, usually the caller's key given as is, would
// never match a check.
func (p Policy) CheckStoredKey(key []byte) error {
	if p.KeyMode == ratelimit.ReadableKeys {
		prefix := p.Name + ":"
		if !bytes.HasPrefix(key, []byte(prefix)) {
			return invalid(nil, "override key of %q, whose keys are readable, does not start with %q: it is not a stored key and would never apply; give the caller's key to Policy.StoredKey (in SQL, pgrl_policy_key(%s, key))", p.Name, prefix, quoteSQL(p.Name))
		}
		if n := len(key) - len(prefix); n > ratelimit.MaxReadableKeyBytes {
			return invalid(ratelimit.ErrKeyTooLong, "override key of %q, whose keys are readable, holds %d bytes after %q: a check refuses keys of more than %d bytes, so it would never apply; shorten the key, or use a policy with hashed keys, which take keys of any length", p.Name, n, prefix, ratelimit.MaxReadableKeyBytes)
		}
		return nil
	}
	if len(key) != hashedKeyBytes {
		return invalid(nil, "override key of %d bytes for %q, whose keys are hashed: a stored key is a %d-byte digest, so it would never apply; give the caller's key to Policy.StoredKey (in SQL, pgrl_policy_key(%s, key))", len(key), p.Name, hashedKeyBytes, quoteSQL(p.Name))
	}
	return nil
}

// hashedKeyBytes is the length of a hashed stored key (ratelimit.StoredKey).
const hashedKeyBytes = 16

// quoteSQL quotes s as an SQL string literal.
func quoteSQL(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// maxStoredKey is the longest stored key: a readable key with its name and
// separator.
const maxStoredKey = ratelimit.MaxReadableNameBytes + 1 + ratelimit.MaxReadableKeyBytes

// The statements of this package exchange instants and durations with the
// database as whole microseconds (bigint), never as timestamptz or interval
// text: in the exec and simple-protocol modes pgx reads and writes text,
// whose form follows the session's DateStyle, IntervalStyle and TimeZone.

// instantUS is the SQL expression of the microseconds since the Unix epoch
// of expr, a timestamptz; NULL stays NULL. It is exact also where extract
// returns float8 (PostgreSQL 13): the whole seconds and the microseconds
// within the second are taken apart.
func instantUS(expr string) string {
	return fmt.Sprintf("(extract(epoch FROM date_trunc('second', %[1]s))::bigint * 1000000"+
		" + extract(microseconds FROM %[1]s)::bigint %% 1000000)", expr)
}

// windowUS is the SQL expression of the microseconds in expr, an interval
// without months (a window: at most 366 days, so that float8 rounds it
// exactly on PostgreSQL 13); NULL stays NULL.
func windowUS(expr string) string {
	return fmt.Sprintf("round(extract(epoch FROM %s) * 1000000)::bigint", expr)
}

// intervalOf is the SQL expression of the interval of the microseconds in
// the bigint expr.
func intervalOf(expr string) string { return "(" + expr + " * interval '1 microsecond')" }

// instantOf is the SQL expression of the timestamptz the microseconds since
// the Unix epoch in the bigint expr name.
func instantOf(expr string) string {
	return "(timestamptz 'epoch' + " + expr + " * interval '1 microsecond')"
}

// micros is d in whole microseconds, nil for 0 (no window: inherit).
func micros(d time.Duration) *int64 {
	if d == 0 {
		return nil
	}
	us := d.Microseconds()
	return &us
}

// duration is a window read as microseconds; NULL is 0.
func duration(us *int64) time.Duration {
	if us == nil {
		return 0
	}
	return time.Duration(*us) * time.Microsecond
}

// instant is an instant read as microseconds since the Unix epoch; NULL is
// the zero time.
func instant(us *int64) time.Time {
	if us == nil {
		return time.Time{}
	}
	return time.UnixMicro(*us)
}

func keyModeName(m ratelimit.KeyMode) string {
	if m == ratelimit.ReadableKeys {
		return "readable"
	}
	return "hashed"
}

// ParseKeyMode accepts "hashed" or "readable", as the table spells them.
func ParseKeyMode(s string) (ratelimit.KeyMode, error) {
	switch s {
	case "hashed", "":
		return ratelimit.HashedKeys, nil
	case "readable":
		return ratelimit.ReadableKeys, nil
	}
	return 0, invalid(nil, "key mode %q; use hashed or readable", s)
}

// policyColumns are the columns scanPolicy reads, in its order.
var policyColumns = `name, algorithm, "limit", ` + windowUS(`"window"`) + `, coalesce(burst, 0), penalty, key_mode,
       coalesce(description, ''), ` + instantUS("created_at") + `, ` + instantUS("updated_at")

// policyFields returns scan destinations for policyColumns and a function
// that completes p from them once scanned.
func policyFields(p *Policy) ([]any, func()) {
	var alg, mode string
	var w, created, updated *int64
	dest := []any{&p.Name, &alg, &p.Limit, &w, &p.Burst, &p.Penalty, &mode, &p.Description, &created, &updated}
	return dest, func() {
		p.Algorithm, p.Window = ratelimit.Algorithm(alg), duration(w)
		p.KeyMode, _ = ParseKeyMode(mode)
		p.CreatedAt, p.UpdatedAt = instant(created), instant(updated)
	}
}

func scanPolicy(row pgx.Row) (Policy, error) {
	var p Policy
	dest, done := policyFields(&p)
	if err := row.Scan(dest...); err != nil {
		return Policy{}, err
	}
	done()
	return p, nil
}

// overrideColumns are the columns scanOverride reads, in its order.
var overrideColumns = `policy, key, coalesce("limit", 0), ` + windowUS(`"window"`) + `, coalesce(burst, 0), ` +
	instantUS("expires_at") + `, coalesce(note, ''), ` + instantUS("created_at") + `, ` + instantUS("updated_at")

// overrideFields returns scan destinations for overrideColumns (each of
// the override's columns may be NULL, as in an outer join) and a function
// that completes o from them once scanned and reports whether there was an
// override.
func overrideFields(o *Override) ([]any, func() bool) {
	var policy *string
	var w, exp, created, updated *int64
	dest := []any{&policy, &o.Key, &o.Limit, &w, &o.Burst, &exp, &o.Note, &created, &updated}
	return dest, func() bool {
		if policy == nil {
			return false
		}
		o.Policy, o.Window, o.ExpiresAt = *policy, duration(w), instant(exp)
		o.CreatedAt, o.UpdatedAt = instant(created), instant(updated)
		return true
	}
}

func scanOverride(row pgx.Row) (Override, error) {
	var o Override
	dest, done := overrideFields(&o)
	if err := row.Scan(dest...); err != nil {
		return Override{}, err
	}
	done()
	return o, nil
}

// Set creates the policy, or replaces the one of that name, in one
// statement, and returns it as stored. It validates first: nothing is
// written when it fails. The change reaches every Listener of the schema.
// Overrides of the policy stay; one that the new policy makes invalid (a
// burst too large for a new algorithm, say) is ignored by limiters, which
// then apply the policy and log a warning. The key mode of a policy with
// overrides cannot change (their keys are stored in it): ErrInvalid.
//
// Set writes every field as p holds it: to change some fields of a stored
// policy and keep the others, use Update, which reads and writes under the
// row's lock. A Get followed by a Set loses the changes that other writers
// make in between.
func Set(ctx context.Context, db DB, p Policy) (Policy, error) {
	return write(ctx, db, p, false)
}

// write validates p and stores it: with create, only when no policy has its
// name (ErrNoRows otherwise, the caller retries); without, creating it or
// replacing the stored one.
func write(ctx context.Context, db DB, p Policy, create bool) (Policy, error) {
	if p.Algorithm == "" {
		p.Algorithm = ratelimit.DefaultAlgorithm
	}
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	var burst *int64
	if p.Burst != 0 {
		burst = &p.Burst
	}
	conflict := `ON CONFLICT (name) DO UPDATE
   SET algorithm = excluded.algorithm, "limit" = excluded."limit", "window" = excluded."window",
       burst = excluded.burst, penalty = excluded.penalty, key_mode = excluded.key_mode,
       description = excluded.description
 WHERE t.key_mode = excluded.key_mode
    OR NOT EXISTS (SELECT 1 FROM pgrl_policy_override AS o WHERE o.policy = t.name)`
	if create {
		conflict = `ON CONFLICT (name) DO NOTHING`
	}
	row := db.QueryRow(ctx, `
INSERT INTO pgrl_policy AS t (name, algorithm, "limit", "window", burst, penalty, key_mode, description)
VALUES ($1, $2, $3, `+intervalOf("$4::bigint")+`, $5, $6, $7, nullif($8, ''))
`+conflict+`
RETURNING `+policyColumns,
		p.Name, string(p.Algorithm), p.Limit, p.Window.Microseconds(), burst, p.Penalty, keyModeName(p.KeyMode), p.Description)
	out, err := scanPolicy(row)
	if errors.Is(err, pgx.ErrNoRows) {
		if create {
			return Policy{}, err
		}
		return Policy{}, invalid(nil, "policy %q has overrides, whose keys are stored in its current key mode; changing it to %s would orphan them: delete them first (rl-policy override list %s), then set them again", p.Name, keyModeName(p.KeyMode), p.Name)
	}
	return out, mapErr(err)
}

// beginner is a DB that can start a transaction (or, on a pgx.Tx, a
// savepoint): *pgxpool.Pool, *pgx.Conn and pgx.Tx all can.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// inTx runs fn in a transaction of db (a savepoint when db is a pgx.Tx).
func inTx(ctx context.Context, db DB, what string, fn func(tx pgx.Tx) error) error {
	b, ok := db.(beginner)
	if !ok {
		return fmt.Errorf("%w: %s reads and writes in one transaction, and %T cannot begin one: pass a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx", ErrInvalid, what, db)
	}
	return pgx.BeginFunc(ctx, b, fn)
}

// updateAttempts bounds how often Update starts over when the policy it
// was about to create was created, or the one it read deleted, meanwhile.
const updateAttempts = 5

// Update changes the policy named name atomically and returns it as stored:
// in one transaction (a savepoint when db is a pgx.Tx) it reads the policy
// with its row locked (SELECT ... FOR UPDATE, after taking pgrl_policy in
// ROW EXCLUSIVE mode, so that rl-policy apply, which holds the table, is
// waited for before the read), calls change with it, validates the result
// and writes it. So concurrent Updates of different fields all apply, each
// on the result of the one before, and an UPDATE by plain SQL is never
// overwritten with what was read before it.
//
// When no policy is named name, change gets a Policy with only Name set
// (CreatedAt zero: test that to tell a creation) and the result is
// inserted; if another writer creates the policy first, Update starts over
// on the stored one. change may be called more than once, so it must only
// set fields; an error it returns ends Update with nothing written, and is
// returned as is. change may not rename the policy (ErrInvalid).
//
// On a pgx.Tx the locks last until that transaction ends, so other writers
// of the policy wait until then.
//
// Under REPEATABLE READ or SERIALIZABLE (db a pgx.Tx of that level), a
// concurrent change makes PostgreSQL refuse the read with a serialization
// failure (SQLSTATE 40001): retry the transaction. Waits for the lock are
// bounded by the session's lock_timeout, if any.
func Update(ctx context.Context, db DB, name string, change func(p *Policy) error) (Policy, error) {
	var out Policy
	for attempt := 1; ; attempt++ {
		retry := false
		err := inTx(ctx, db, "policy.Update", func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `LOCK TABLE pgrl_policy IN ROW EXCLUSIVE MODE`); err != nil {
				return mapErr(err)
			}
			p, err := scanPolicy(tx.QueryRow(ctx, `SELECT `+policyColumns+` FROM pgrl_policy WHERE name = $1 FOR UPDATE`, name))
			exists := true
			if errors.Is(err, pgx.ErrNoRows) {
				p, exists, err = Policy{Name: name}, false, nil
			}
			if err != nil {
				return mapErr(err)
			}
			if err := change(&p); err != nil {
				return err
			}
			if p.Name != name {
				return invalid(nil, "policy.Update of %q renamed it to %q; a policy keeps its name: Set a policy of the new name, then Delete this one", name, p.Name)
			}
			out, err = write(ctx, tx, p, !exists)
			if !exists && errors.Is(err, pgx.ErrNoRows) {
				retry = true // created meanwhile: read it, locked
			}
			return err
		})
		if !retry {
			return out, err
		}
		if attempt == updateAttempts {
			return Policy{}, fmt.Errorf("policy: Update of %q: the policy was created and deleted again by other writers %d times while this one tried to change it; try again", name, attempt)
		}
	}
}

// Get returns the policy named name, or ErrNotFound.
func Get(ctx context.Context, db DB, name string) (Policy, error) {
	p, err := scanPolicy(db.QueryRow(ctx, `SELECT `+policyColumns+` FROM pgrl_policy WHERE name = $1`, name))
	if errors.Is(err, pgx.ErrNoRows) {
		return Policy{}, notFound(name)
	}
	return p, explainRead(ctx, db, err)
}

// notFound is ErrNotFound for the policy named name.
func notFound(name string) error {
	return fmt.Errorf("%w: no policy is named %q; list them with `rl-policy list`, create it with `rl-policy set %s --limit N --window D`", ErrNotFound, name, name)
}

// List returns every policy, by name.
func List(ctx context.Context, db DB) ([]Policy, error) {
	rows, err := db.Query(ctx, `SELECT `+policyColumns+` FROM pgrl_policy ORDER BY name`)
	if err != nil {
		return nil, explainRead(ctx, db, err)
	}
	ps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Policy, error) { return scanPolicy(r) })
	if ps == nil {
		ps = []Policy{}
	}
	return ps, explainRead(ctx, db, err)
}

// Delete removes the policy and its overrides (ON DELETE CASCADE), or
// returns ErrNotFound. Limiters of a deleted policy return ErrNotFound from
// then on. The counters stay until rl-cleanup removes them.
func Delete(ctx context.Context, db DB, name string) error {
	tag, err := db.Exec(ctx, `DELETE FROM pgrl_policy WHERE name = $1`, name)
	if err != nil {
		return mapErr(err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: no policy is named %q; nothing deleted", ErrNotFound, name)
	}
	return nil
}

// SetOverride creates or replaces the override of o.Key under o.Policy and
// returns it as stored. In one transaction (a savepoint when db is a
// pgx.Tx) it reads the policy with its row locked against writers (SELECT
// ... FOR NO KEY UPDATE, after taking pgrl_policy in ROW EXCLUSIVE mode:
// the override's trigger updates that row, migration 000020, and a weaker
// lock taken first would have to be strengthened there, which deadlocks
// with a writer queued behind it, such as rl-policy apply), validates the
// rate the key would get under it, and writes the override, so that a
// change of the policy made meanwhile (a new key mode, algorithm or burst)
// waits for it instead of slipping between the check and the write. An override of a policy that does not exist is
// ErrNotFound. An ExpiresAt that is not after the database's now() is
// ErrInvalid: such an override would never apply (delete an override to
// end it). Nothing is written when it fails.
func SetOverride(ctx context.Context, db DB, o Override) (Override, error) {
	var out Override
	err := inTx(ctx, db, "policy.SetOverride", func(tx pgx.Tx) error {
		// The lock the trigger's update needs, taken first: rl-policy
		// apply locks the table against row writers and then waits for
		// this row, which must not be held by a writer that still needs it.
		if _, err := tx.Exec(ctx, `LOCK TABLE pgrl_policy IN ROW EXCLUSIVE MODE`); err != nil {
			return err
		}
		p, err := scanPolicy(tx.QueryRow(ctx, `SELECT `+policyColumns+` FROM pgrl_policy WHERE name = $1 FOR NO KEY UPDATE`, o.Policy))
		if errors.Is(err, pgx.ErrNoRows) {
			return notFound(o.Policy)
		}
		if err != nil {
			return mapErr(err)
		}
		out, err = writeOverride(ctx, tx, p, o)
		return err
	})
	return out, err
}

// writeOverride validates o against p and writes it.
func writeOverride(ctx context.Context, db DB, p Policy, o Override) (Override, error) {
	if err := o.Validate(p); err != nil {
		return Override{}, err
	}
	nz := func(v int64) *int64 {
		if v == 0 {
			return nil
		}
		return &v
	}
	var exp *int64
	if !o.ExpiresAt.IsZero() {
		us := o.ExpiresAt.UnixMicro()
		exp = &us
	}
	row := db.QueryRow(ctx, `
INSERT INTO pgrl_policy_override AS t (policy, key, "limit", "window", burst, expires_at, note)
SELECT $1::text, $2::bytea, $3::bigint, `+intervalOf("$4::bigint")+`, $5::bigint, `+instantOf("$6::bigint")+`,
       nullif($7::text, '')
 WHERE $6::bigint IS NULL OR `+instantOf("$6::bigint")+` > now()
ON CONFLICT (policy, key) DO UPDATE
   SET "limit" = excluded."limit", "window" = excluded."window", burst = excluded.burst,
       expires_at = excluded.expires_at, note = excluded.note
RETURNING `+overrideColumns,
		o.Policy, o.Key, nz(o.Limit), micros(o.Window), nz(o.Burst), exp, o.Note)
	out, err := scanOverride(row)
	if errors.Is(err, pgx.ErrNoRows) {
		return Override{}, invalid(nil, "override of %q expires at %s, which is not in the future on the database's clock: give a later ExpiresAt (or none, for never); to end an override now, delete it (DeleteOverride, rl-policy override delete)", o.Policy, o.ExpiresAt.UTC().Format(time.RFC3339Nano))
	}
	return out, mapErr(err)
}

// ListOverrides returns the overrides of the policy named policyName (of
// every policy when it is empty), expired ones included, by policy and
// key.
func ListOverrides(ctx context.Context, db DB, policyName string) ([]Override, error) {
	rows, err := db.Query(ctx, `SELECT `+overrideColumns+` FROM pgrl_policy_override
 WHERE $1 = '' OR policy = $1 ORDER BY policy, key`, policyName)
	if err != nil {
		return nil, explainRead(ctx, db, err)
	}
	os, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Override, error) { return scanOverride(r) })
	if os == nil {
		os = []Override{}
	}
	return os, explainRead(ctx, db, err)
}

// DeleteOverride removes the override of the stored key under policyName,
// or returns ErrNotFound.
func DeleteOverride(ctx context.Context, db DB, policyName string, key []byte) error {
	tag, err := db.Exec(ctx, `DELETE FROM pgrl_policy_override WHERE policy = $1 AND key = $2`, policyName, key)
	if err != nil {
		return mapErr(err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: policy %q has no override for this key; nothing deleted", ErrNotFound, policyName)
	}
	return nil
}
