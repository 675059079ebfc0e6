package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/metrics"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// The app's limits. Choose the store by what a wrong count would cost: a
// limit that protects accounts, inboxes or money is shared by every
// instance (PostgreSQL); a limit that only dampens noise may live in each
// process's memory and never touch the database.
//
//	what it protects                     limit        store     key
//	login, per email and client IP       5 / min      Postgres  email + IP
//	login, per client IP (all emails)    20 / min     Postgres  IP
//	login, per email (all IPs)           50 / 15 min  Postgres  email
//	contact form                         5 / min      Postgres  IP
//	confirmation emails, per recipient   3 / day      Postgres  recipient
//	admin writes                         30 / min     Postgres  admin user
//	uploads                              10 / min     Postgres  user, else IP
//	public API                           120 / min    Postgres  API key, else IP
//	analytics beacon                     60 / min     memory    IP
//
// The shared limits live in table pgrl_policy: the values below are only
// what seedPolicies inserts when a policy is missing. Once stored, the row
// is the limit: an UPDATE (or rl-policy set) changes it in every running
// instance within a second, and a restart does not put these values back.
// Per-key overrides (pgrl_policy_override) give one key another limit;
// the key is the one the key functions below return ("key:" + the API key
// for the public API).
//
// The login limits use the sliding window, so that a guesser cannot spend a
// whole quota at the end of one window and another at the start of the
// next; the others use the cheaper fixed window.
var defaults = struct {
	LoginEmailIP, LoginIP, LoginEmail, Contact, Confirmation, AdminWrites, Uploads, PublicAPI, Beacon limitSpec
}{
	LoginEmailIP: limitSpec{"login-email-ip", ratelimit.SlidingWindow, 5, time.Minute, "login attempts per email and client IP"},
	LoginIP:      limitSpec{"login-ip", ratelimit.SlidingWindow, 20, time.Minute, "login attempts per client IP, all emails"},
	LoginEmail:   limitSpec{"login-email", ratelimit.SlidingWindow, 50, 15 * time.Minute, "login attempts per email, all IPs"},
	Contact:      limitSpec{"contact", ratelimit.FixedWindow, 5, time.Minute, "contact form per client IP"},
	Confirmation: limitSpec{"confirmation-email", ratelimit.FixedWindow, 3, 24 * time.Hour, "confirmation emails per recipient"},
	AdminWrites:  limitSpec{"admin-writes", ratelimit.FixedWindow, 30, time.Minute, "admin writes per admin user"},
	Uploads:      limitSpec{"uploads", ratelimit.FixedWindow, 10, time.Minute, "uploads per user, else client IP"},
	PublicAPI:    limitSpec{"public-api", ratelimit.FixedWindow, 120, time.Minute, "public API per API key (key:K), else client IP (ip:A)"},
	// Not stored: see newLimits.
	Beacon: limitSpec{"beacon", ratelimit.FixedWindow, 60, time.Minute, "analytics beacon per client IP, in each process's memory"},
}

// limitSpec is one row of the table above.
type limitSpec struct {
	Name        string
	Algorithm   ratelimit.Algorithm
	Limit       int64
	Window      time.Duration
	Description string
}

// shared lists the limits kept in pgrl_policy, in the order above.
func shared() []limitSpec {
	d := defaults
	return []limitSpec{d.LoginEmailIP, d.LoginIP, d.LoginEmail, d.Contact, d.Confirmation, d.AdminWrites, d.Uploads, d.PublicAPI}
}

// seedPolicies stores the shared limits that pgrl_policy lacks, and leaves
// the others alone: a policy already there (changed by a DBA, say) is
// never overwritten. Instances starting together may all run it; ON
// CONFLICT makes the losers' inserts no-ops. It needs INSERT on
// pgrl_policy, which the migrating role has.
func seedPolicies(ctx context.Context, db policy.DB) (created []string, err error) {
	for _, s := range shared() {
		tag, err := db.Exec(ctx, `
INSERT INTO pgrl_policy (name, algorithm, "limit", "window", description)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (name) DO NOTHING`,
			s.Name, string(s.Algorithm), s.Limit, pgtype.Interval{Microseconds: s.Window.Microseconds(), Valid: true}, s.Description)
		if err != nil {
			return created, fmt.Errorf("seed policy %q: %w", s.Name, err)
		}
		if tag.RowsAffected() == 1 {
			created = append(created, s.Name)
		}
	}
	return created, nil
}

// limits holds the app's limiters and the middleware built on them.
type limits struct {
	// Login is checked as one decision over three limits.
	Login *httplimit.Middleware
	// Contact guards the contact form; Confirmation is checked inside its
	// handler, per recipient, to decide whether to send the email.
	Contact      *httplimit.Middleware
	Confirmation *policy.Limiter
	AdminWrites  *httplimit.Middleware
	Uploads      *httplimit.Middleware
	PublicAPI    *httplimit.Middleware
	Beacon       *httplimit.Middleware
	// Names lists every limiter's name, for metrics.
	Names []string
}

// newLimits builds the app's limiters: the shared ones from the policies
// stored in pgrl_policy, each single check reading its policy and the key's
// override in its own statement (the login's three limits, decided
// together, use the rates in the cache, which a policy.Listener keeps
// current), the beacon's in memory.
func newLimits(ctx context.Context, pool *pgxpool.Pool, cache *policy.Cache, ips *clientip.Resolver, col *metrics.Collector, opts httplimit.Config) (*limits, error) {
	l := &limits{}
	// What every limit in this database shares. When PostgreSQL is down or
	// slower than Timeout, each process keeps limiting on its own, in
	// memory (FailToMemory, every policy's default), and logs the outage
	// once.
	db, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{
		Timeout:  250 * time.Millisecond,
		Observer: col,
		Logger:   opts.Logger,
	})
	if err != nil {
		return nil, err
	}
	stored := func(s limitSpec) *policy.Limiter {
		if err != nil {
			return nil
		}
		var lim *policy.Limiter
		lim, err = policy.NewLimiter(ctx, pool, s.Name, policy.Options{Cache: cache, Database: db})
		l.Names = append(l.Names, s.Name)
		return lim
	}
	loginEmailIP := stored(defaults.LoginEmailIP)
	loginIP := stored(defaults.LoginIP)
	loginEmail := stored(defaults.LoginEmail)
	contact := stored(defaults.Contact)
	l.Confirmation = stored(defaults.Confirmation)
	admin := stored(defaults.AdminWrites)
	uploads := stored(defaults.Uploads)
	api := stored(defaults.PublicAPI)
	if err != nil {
		return nil, err
	}
	// The beacon is high volume and low stakes: a memory-only limit adds no
	// database write per page view. Each process counts on its own, so it
	// is not a shared limit and has no row in pgrl_policy: it changes with
	// a deploy.
	beacon, err := ratelimit.NewMemory(ratelimit.Config{
		Name: defaults.Beacon.Name, Limit: defaults.Beacon.Limit, Window: defaults.Beacon.Window,
	}, ratelimit.MemoryOptions{MaxKeys: 100_000})
	if err != nil {
		return nil, err
	}

	byIP := httplimit.ByIP(ips)
	mw := func(cfg httplimit.Config) *httplimit.Middleware {
		if err != nil {
			return nil
		}
		cfg.Headers, cfg.Logger = opts.Headers, opts.Logger
		var m *httplimit.Middleware
		m, err = httplimit.New(cfg)
		return m
	}
	// A login is one decision over three limits, all or nothing: a request
	// denied by one limit consumes none of the others, so an attacker who
	// hammers one email from one address does not lock that email out for
	// its owner everywhere else any faster than the per-email limit says.
	// Each request is checked at the rate stored for its key now (Keyed).
	l.Login = mw(httplimit.Config{Rules: []httplimit.Rule{
		{Keyed: loginEmailIP, Key: httplimit.Combine(emailKey, byIP)},
		{Keyed: loginIP, Key: byIP},
		{Keyed: loginEmail, Key: emailKey},
	}})
	l.Contact = mw(httplimit.Config{Limiter: contact, Key: byIP})
	l.AdminWrites = mw(httplimit.Config{Limiter: admin, Key: adminUser})
	l.Uploads = mw(httplimit.Config{Limiter: uploads, Key: userOrIP(byIP)})
	l.PublicAPI = mw(httplimit.Config{Limiter: api, Key: apiKeyOrIP(byIP)})
	l.Beacon = mw(httplimit.Config{Limiter: beacon, Key: byIP})
	if err != nil {
		return nil, fmt.Errorf("rate limits: %w", err)
	}
	return l, nil
}

// maxFormBytes bounds the form bodies the app reads.
const maxFormBytes = 64 << 10

// emailKey keys a login by the email typed into the form, normalised so
// that "Ann@Example.com " and "ann@example.com" share a count. A request
// without one skips the email limits (the handler refuses it anyway).
func emailKey(r *http.Request) (string, bool) {
	r.Body = http.MaxBytesReader(nil, r.Body, maxFormBytes)
	email := normalizeEmail(r.PostFormValue("email"))
	return email, email != ""
}

func normalizeEmail(s string) string { return strings.ToLower(strings.TrimSpace(s)) }

// adminUser keys admin writes by the authenticated admin. This example
// takes the bearer token as the identity; use your own authentication.
func adminUser(r *http.Request) (string, bool) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return tok, ok && tok != ""
}

// userOrIP keys by the signed-in user when there is one, else by address.
func userOrIP(byIP httplimit.KeyFunc) httplimit.KeyFunc {
	return func(r *http.Request) (string, bool) {
		if u, ok := adminUser(r); ok {
			return "user:" + u, true
		}
		ip, ok := byIP(r)
		return "ip:" + ip, ok
	}
}

// apiKeyOrIP keys public API calls by API key, else by address, so that
// anonymous callers share their address's budget and keyed callers get
// their own.
func apiKeyOrIP(byIP httplimit.KeyFunc) httplimit.KeyFunc {
	return func(r *http.Request) (string, bool) {
		if k := r.Header.Get("X-API-Key"); k != "" {
			return "key:" + k, true
		}
		ip, ok := byIP(r)
		return "ip:" + ip, ok
	}
}
