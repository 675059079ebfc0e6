// Command app is a small net/http service with the rate limits of a typical
// website (login, contact form, confirmation emails, admin writes, uploads,
// public API, analytics beacon), kept in PostgreSQL with pgrl so that every
// instance shares them. It is written to be copied: see limits.go for the
// limits and docs/HTTP.md for how to run it.
//
//	go run ./examples/app --addr 127.0.0.1:8080
//
// Flags:
//
//	--addr             address to listen on (default 127.0.0.1:8080)
//	--database-url     PostgreSQL URL; else $DATABASE_URL; else the local test
//	                   database
//	--schema           schema of the app's own for pgrl's tables (default
//	                   pgrl_example_app); the URL's search_path is ignored
//	--trusted-proxies  comma-separated CIDRs of the proxies in front of the app,
//	                   whose X-Forwarded-For is believed (default: none)
//	--ipv6-prefix      group IPv6 clients by this prefix length (default 64)
//	--legacy-headers   also send X-RateLimit-Limit/Remaining/Reset
//	--policy-listener  follow changes of the stored limits as they are
//	                   committed (default true); false: keep the limits
//	                   loaded at start-up until a restart
//	--listener-url     PostgreSQL URL of the listener's own connection: a
//	                   direct one, or PgBouncer in session mode, never
//	                   transaction mode (default: --database-url)
//
// At start-up it creates the schema --schema when it is missing and applies
// pgrl's migrations to it (several instances may start at once); it logs the
// schema's name. It writes into no other schema: not public, nor the schema
// a URL's search_path names, which is likely another application's. It
// stops cleanly on SIGINT or SIGTERM, finishing requests in flight.
//
// # Limits from the database
//
// The shared limits are rows of table pgrl_policy (docs/POLICIES.md). At
// start-up the app inserts those that are missing with the values of
// limits.go, never changing a stored one; then it reads them from an
// in-memory cache that a listener (LISTEN pgrl_policy) keeps current. A DBA
// changes a limit for every running instance, within a second, with
//
//	UPDATE pgrl_policy SET "limit" = 240 WHERE name = 'public-api';
//
// or rl-policy set public-api --limit 240. One API key gets ten times the
// public API's quota (1,200 a minute) with an override; the app keys API
// calls by "key:" and the X-API-Key header, so for the API key K:
//
//	rl-policy override set public-api key:K --limit 1200 --note "partner, ticket 123"
//
// or, in SQL, with search_path set to the app's schema (pgrl_example_app):
//
//	INSERT INTO pgrl_policy_override (policy, key, "limit", note)
//	VALUES ('public-api', pgrl_stored_key('public-api', 'key:K'), 1200, 'partner, ticket 123');
//
// The key's next request is checked against 1,200, and its RateLimit-Policy
// field says "public-api";q=1200;w=60.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pgrl/pgrl/clientip"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/metrics"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// DefaultDatabaseURL is the database used when neither --database-url nor
// DATABASE_URL is set: the local test server.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable"

// DefaultSchema is the schema that holds pgrl's tables for the app, in
// whatever database it runs, unless --schema names another.
const DefaultSchema = "pgrl_example_app"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

type options struct {
	addr           string
	databaseURL    string
	schema         string
	trustedProxies string
	ipv6Prefix     int
	legacyHeaders  bool
	policyListener bool
	listenerURL    string
}

// run runs the service until ctx ends. It returns the exit code: 0 after a
// clean shutdown, 1 on a runtime error, 2 on a usage error.
func run(ctx context.Context, args []string, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var o options
	fs := flag.NewFlagSet("app", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8080", "address to listen on")
	fs.StringVar(&o.databaseURL, "database-url", "", "PostgreSQL URL (default $DATABASE_URL, else "+DefaultDatabaseURL+")")
	fs.StringVar(&o.schema, "schema", DefaultSchema, "schema of the app's own for pgrl's tables, created when missing (the URL's search_path is ignored)")
	fs.StringVar(&o.trustedProxies, "trusted-proxies", "", "comma-separated CIDRs of trusted reverse proxies")
	fs.IntVar(&o.ipv6Prefix, "ipv6-prefix", 64, "group IPv6 clients by this prefix length (0: no grouping)")
	fs.BoolVar(&o.legacyHeaders, "legacy-headers", false, "also send X-RateLimit-Limit, -Remaining and -Reset")
	fs.BoolVar(&o.policyListener, "policy-listener", true, "follow changes of the limits stored in pgrl_policy (LISTEN); false: keep those loaded at start-up")
	fs.StringVar(&o.listenerURL, "listener-url", "", "PostgreSQL URL of the policy listener's own connection: direct, or PgBouncer in session mode (default --database-url)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "app: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if o.databaseURL == "" {
		o.databaseURL = os.Getenv("DATABASE_URL")
	}
	// PostgreSQL would cut a longer name to 63 bytes: another schema.
	if o.schema == "" || len(o.schema) > 63 {
		fmt.Fprintf(stderr, "app: --schema %q: give a schema name of 1 to 63 bytes\n", o.schema)
		return 2
	}
	if o.databaseURL == "" {
		o.databaseURL = DefaultDatabaseURL
	}
	if o.listenerURL == "" {
		o.listenerURL = o.databaseURL
	}
	listenerURL, err := withSearchPath(o.listenerURL, o.schema)
	if err != nil {
		fmt.Fprintf(stderr, "app: --listener-url: %v\n", err)
		return 2
	}
	o.listenerURL = listenerURL
	proxies, err := clientip.ParsePrefixes(o.trustedProxies)
	if err != nil {
		fmt.Fprintf(stderr, "app: --trusted-proxies: %v\n", err)
		return 2
	}
	ips, err := clientip.New(clientip.Config{IPv6Prefix: o.ipv6Prefix})
	if err != nil {
		fmt.Fprintf(stderr, "app: --ipv6-prefix: %v\n", err)
		return 2
	}
	ips.TrustedProxies = proxies
	if err := serve(ctx, o, ips, log); err != nil {
		log.Error("app stopped", "err", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, o options, ips *clientip.Resolver, log *slog.Logger) error {
	if err := migrate(ctx, o.databaseURL, o.schema, log); err != nil {
		return err
	}
	pool, err := openPool(ctx, o.databaseURL, o.schema, checkPool)
	if err != nil {
		return err
	}
	defer pool.Close()
	// The policy reads (a reload reads every override) are not checks:
	// they get a small pool of their own, without the checks' short
	// statement timeout.
	policyPool, err := openPool(ctx, o.databaseURL, o.schema, policiesPool)
	if err != nil {
		return err
	}
	defer policyPool.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	col, err := metrics.New(reg)
	if err != nil {
		return err
	}
	cache, stopListener, err := loadPolicies(ctx, o, policyPool, reg, log)
	if err != nil {
		return err
	}
	defer stopListener() // after the server's shutdown: requests in flight still follow changes
	headers := httplimit.HeadersDraft
	if o.legacyHeaders {
		headers = httplimit.HeadersDraftAndLegacy
	}
	lims, err := newLimits(ctx, pool, cache, ips, col, httplimit.Config{Headers: headers, Logger: log})
	if err != nil {
		return err
	}
	col.Init(lims.Names...)

	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler:           routes(lims, reg, log),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	log.Info("listening", "addr", ln.Addr().String(), "trusted_proxies", len(ips.TrustedProxies))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	log.Info("stopped")
	return nil
}

// loadPolicies stores the default limits that pgrl_policy lacks, and
// returns the cache the limiters read them from: kept current by a
// listener on its own connection, which stop closes, or with
// --policy-listener=false, loaded once.
func loadPolicies(ctx context.Context, o options, pool *pgxpool.Pool, reg prometheus.Registerer, log *slog.Logger) (cache *policy.Cache, stop func(), err error) {
	created, err := seedPolicies(ctx, pool)
	if err != nil {
		return nil, nil, err
	}
	if len(created) > 0 {
		log.Info("stored the default limits", "policies", created)
	}
	cache = policy.NewCache(pool)
	if !o.policyListener {
		if err := cache.Reload(ctx); err != nil {
			return nil, nil, err
		}
		log.Info("policy listener off: the limits stay as loaded until a restart")
		return cache, func() {}, nil
	}
	l, err := policy.Watch(ctx, o.listenerURL, cache, policy.ListenerOptions{Logger: log})
	if err != nil {
		return nil, nil, fmt.Errorf("--listener-url: %w", err)
	}
	stop = func() { _ = l.Close() }
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := l.WaitSynced(wctx); err != nil {
		stop()
		return nil, nil, fmt.Errorf("%w; check --listener-url (a direct connection, or PgBouncer in session mode), or run with --policy-listener=false", err)
	}
	if _, err := metrics.NewPolicyCollector(reg, l, cache); err != nil {
		stop()
		return nil, nil, err
	}
	log.Info("following the limits stored in pgrl_policy", "schema", cache.Schema())
	return cache, stop, nil
}

// migrate applies pgrl's migrations to schema, creating it if need be.
// Instances starting together take turns on an advisory lock; all but the
// first find nothing to do.
func migrate(ctx context.Context, url, schema string, log *slog.Logger) error {
	m, err := migration.New(url, migration.Config{Schema: schema, Logger: log})
	if err != nil {
		return err
	}
	defer func() { _ = m.Close() }()
	res, err := m.Up(ctx)
	if err != nil {
		return fmt.Errorf("migrate schema %q: %w", schema, err)
	}
	log.Info("pgrl schema ready", "schema", res.Schema, "version", res.To, "applied", len(res.Applied))
	return nil
}

// withSearchPath returns connString (a URL or keyword/value string) with
// search_path set to schema alone, for the connections pgx opens from a
// string, such as the policy listener's.
func withSearchPath(connString, schema string) (string, error) {
	path := pgx.Identifier{schema}.Sanitize()
	if u, err := url.Parse(connString); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("search_path", path)
		// pgx reads "+" in a query as itself, not as a space.
		u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
		return u.String(), nil
	}
	if _, err := pgx.ParseConfig(connString); err != nil {
		return "", fmt.Errorf("database URL: %w", err)
	}
	quoted := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(path)
	return strings.TrimSpace(connString + " search_path='" + quoted + "'"), nil
}

// poolKind says what a pool is for.
type poolKind int

const (
	// checkPool runs the limiters' checks: its server-side statement
	// timeout is a little shorter than the limiters' client timeout, so
	// that a slow check is abandoned by the server and the connection
	// survives.
	checkPool poolKind = iota
	// policiesPool seeds the policies and loads them into the cache: two
	// connections at most, statements of up to 30 s.
	policiesPool
)

// openPool connects to PostgreSQL for the given use, with search_path set
// to schema.
func openPool(ctx context.Context, url, schema string, kind poolKind) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "pgrl-example-app"
	}
	switch kind {
	case checkPool:
		cfg.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = "200ms"
	case policiesPool:
		cfg.ConnConfig.RuntimeParams[ratelimit.StatementTimeoutParam] = "30s"
		cfg.MaxConns, cfg.MinConns = 2, 0
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database unreachable: %w", err)
	}
	return pool, nil
}
