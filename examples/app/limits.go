package main

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/ratelimit"
	"github.com/pgrl/pgrl/ratelimit/metrics"
)

// The policy table. Choose the store by what a wrong count would cost: a
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
var policy = struct {
	LoginEmailIP, LoginIP, LoginEmail, Contact, Confirmation, AdminWrites, Uploads, PublicAPI, Beacon limitSpec
}{
	LoginEmailIP: limitSpec{"login-email-ip", 5, time.Minute},
	LoginIP:      limitSpec{"login-ip", 20, time.Minute},
	LoginEmail:   limitSpec{"login-email", 50, 15 * time.Minute},
	Contact:      limitSpec{"contact", 5, time.Minute},
	Confirmation: limitSpec{"confirmation-email", 3, 24 * time.Hour},
	AdminWrites:  limitSpec{"admin-writes", 30, time.Minute},
	Uploads:      limitSpec{"uploads", 10, time.Minute},
	PublicAPI:    limitSpec{"public-api", 120, time.Minute},
	Beacon:       limitSpec{"beacon", 60, time.Minute},
}

// limitSpec is one row of the policy table.
type limitSpec struct {
	Name   string
	Limit  int64
	Window time.Duration
}

// limits holds the app's limiters and the middleware built on them.
type limits struct {
	// Login is checked as one decision over three limits.
	Login *httplimit.Middleware
	// Contact guards the contact form; Confirmation is checked inside its
	// handler, per recipient, to decide whether to send the email.
	Contact      *httplimit.Middleware
	Confirmation *ratelimit.Limiter
	AdminWrites  *httplimit.Middleware
	Uploads      *httplimit.Middleware
	PublicAPI    *httplimit.Middleware
	Beacon       *httplimit.Middleware
	// Names lists every limiter's name, for metrics.
	Names []string
}

// newLimits builds the limiters of the policy table on pool.
func newLimits(pool *pgxpool.Pool, ips *clientip.Resolver, col *metrics.Collector, opts httplimit.Config) (*limits, error) {
	l := &limits{}
	var err error
	shared := func(s limitSpec, a ratelimit.Algorithm) *ratelimit.Limiter {
		if err != nil {
			return nil
		}
		var lim *ratelimit.Limiter
		lim, err = ratelimit.New(pool, ratelimit.Config{
			Name:      s.Name,
			Algorithm: a,
			Limit:     s.Limit,
			Window:    s.Window,
			// When PostgreSQL is down or slower than this, each process
			// keeps limiting on its own, in memory (FailToMemory, the
			// default), and logs the outage once.
			Timeout:  250 * time.Millisecond,
			Observer: col,
			Logger:   opts.Logger,
		})
		l.Names = append(l.Names, s.Name)
		return lim
	}
	// The login limits use the sliding window, so that a guesser cannot
	// spend a whole quota at the end of one window and another at the start
	// of the next; the others use the cheaper fixed window.
	loginEmailIP := shared(policy.LoginEmailIP, ratelimit.SlidingWindow)
	loginIP := shared(policy.LoginIP, ratelimit.SlidingWindow)
	loginEmail := shared(policy.LoginEmail, ratelimit.SlidingWindow)
	contact := shared(policy.Contact, ratelimit.FixedWindow)
	l.Confirmation = shared(policy.Confirmation, ratelimit.FixedWindow)
	admin := shared(policy.AdminWrites, ratelimit.FixedWindow)
	uploads := shared(policy.Uploads, ratelimit.FixedWindow)
	api := shared(policy.PublicAPI, ratelimit.FixedWindow)
	if err != nil {
		return nil, err
	}
	// The beacon is high volume and low stakes: a memory-only limit adds no
	// database write per page view. Each process counts on its own.
	beacon, err := ratelimit.NewMemory(ratelimit.Config{
		Name: policy.Beacon.Name, Limit: policy.Beacon.Limit, Window: policy.Beacon.Window,
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
	l.Login = mw(httplimit.Config{Rules: []httplimit.Rule{
		{Limiter: loginEmailIP, Key: httplimit.Combine(emailKey, byIP)},
		{Limiter: loginIP, Key: byIP},
		{Limiter: loginEmail, Key: emailKey},
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
