package main

// --concurrency: what taking a slot of a concurrency limit costs beside a
// fixed-window check, and what the slots a process holds cost while held.

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/loadtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// The concurrency limit of the acquire path.
const (
	// concurrencyLimit is how many slots of a key may be held at once: far
	// more than any number of callers, so that no acquire is refused.
	concurrencyLimit = 1_000_000
	// concurrencyLease is the acquire path's Window. Its slots are held for
	// a round trip; the Database extends whatever it holds at that moment
	// every 10 s (a third of it), one statement among the acquires.
	concurrencyLease = 30 * time.Second
	concurrencyName  = "rl-bench-concurrency"
)

// ConcurrencyCase is one number of callers over one key spread with
// --concurrency: Limiter.Acquire then Slot.Release against Limiter.Allow
// of a fixed window, on one Database, interleaved. Ratios are acquire over
// allow.
type ConcurrencyCase struct {
	Callers int `json:"callers"`
	Keys    int `json:"keys"`
	// AllowChecks and Acquires are how many of each were measured (each
	// acquire was followed by its release).
	AllowChecks int `json:"allow_checks"`
	Acquires    int `json:"acquires"`
	// AllowOpsPerSec is fixed-window checks per second; AcquireOpsPerSec
	// is acquires, each with its release, per second.
	AllowOpsPerSec   float64 `json:"allow_ops_per_sec"`
	AcquireOpsPerSec float64 `json:"acquire_release_ops_per_sec"`
	AllowP50Us       float64 `json:"allow_p50_us"`
	AllowP99Us       float64 `json:"allow_p99_us"`
	// AcquireP50Us and AcquireP99Us are of the acquire alone;
	// AcquireReleaseP50Us and AcquireReleaseP99Us of the acquire and its
	// release, one after the other.
	AcquireP50Us        float64 `json:"acquire_p50_us"`
	AcquireP99Us        float64 `json:"acquire_p99_us"`
	AcquireReleaseP50Us float64 `json:"acquire_release_p50_us"`
	AcquireReleaseP99Us float64 `json:"acquire_release_p99_us"`
	// AcquireP50Ratio is AcquireP50Us / AllowP50Us; AcquireReleaseP50Ratio
	// is AcquireReleaseP50Us / AllowP50Us.
	AcquireP50Ratio        float64 `json:"acquire_p50_ratio"`
	AcquireReleaseP50Ratio float64 `json:"acquire_release_p50_ratio"`
	// AllowFallbacks and AcquireFallbacks count the measured decisions
	// that PostgreSQL did not make (the failure policy answered, after the
	// Database's Timeout): their latency is not the statement's.
	AllowFallbacks   int64 `json:"allow_fallbacks,omitempty"`
	AcquireFallbacks int64 `json:"acquire_fallbacks,omitempty"`
}

// HoldReport is what holding slots costs (--concurrency with --hold-for):
// every number of slots of --hold-slots held at once, each group by a
// Database of its own (as by a process of its own), for --hold-for.
type HoldReport struct {
	// WindowSeconds is the limits' Window, the slots' lease;
	// IntervalSeconds the keeper's interval, a third of it.
	WindowSeconds   float64 `json:"window_seconds"`
	IntervalSeconds float64 `json:"interval_seconds"`
	// HoldSeconds is --hold-for.
	HoldSeconds float64    `json:"hold_seconds"`
	Cases       []HoldCase `json:"cases"`
	// Statements is the extension statements all groups sent, counted as
	// they went through the Databases' DB.
	Statements int64 `json:"statements"`
	// RowWrites is the rows of pgrl_concurrency inserted or updated while
	// the slots were taken, held and released (pg_stat_user_tables), and
	// ExpectedRowWrites what the statements counted account for: one per
	// acquire, one per release, one per key of each extension.
	RowWrites         int64 `json:"row_writes"`
	ExpectedRowWrites int64 `json:"expected_row_writes"`
	// PgStatStatementsCalls is the calls of the extension statement that
	// pg_stat_statements counted in this database meanwhile (those of any
	// other session included); nil when it cannot be read, and
	// PgStatStatements says why.
	PgStatStatementsCalls *int64 `json:"pg_stat_statements_calls,omitempty"`
	PgStatStatements      string `json:"pg_stat_statements,omitempty"`
}

// HoldCase is one group of slots held at once.
type HoldCase struct {
	Slots int `json:"slots"`
	Keys  int `json:"keys"`
	// HeldSeconds is from the first acquire to the first release.
	HeldSeconds float64 `json:"held_seconds"`
	// Statements is the extension statements sent in that time;
	// ExpectedStatements how many the keeper's schedule (one per
	// interval, the first an interval after the first acquire) makes.
	Statements         int `json:"statements"`
	ExpectedStatements int `json:"expected_statements"`
	// StatementsPerMinute is the rate they went out at (from the first to
	// the last); PerSlotPerMinute that over Slots, and
	// ExpectedPerSlotPerMinute the schedule's: 3 per Window, over Slots.
	StatementsPerMinute      float64 `json:"statements_per_minute"`
	PerSlotPerMinute         float64 `json:"per_slot_per_minute"`
	ExpectedPerSlotPerMinute float64 `json:"expected_per_slot_per_minute"`
	// StatementP50Ms and StatementMaxMs are how long an extension took.
	StatementP50Ms float64 `json:"statement_p50_ms"`
	StatementMaxMs float64 `json:"statement_max_ms"`
	// Lost is the slots lost before their release (ratelimit.ErrSlotLost).
	Lost int `json:"lost"`
}

// concurrencyWorkload is the acquire path's limit and keys.
type concurrencyWorkload struct {
	cfg    ratelimit.Config
	keys   []string
	hashed [][]byte
}

func newConcurrencyWorkload(nkeys int) concurrencyWorkload {
	w := concurrencyWorkload{
		cfg: ratelimit.Config{
			Name: concurrencyName, Algorithm: ratelimit.Concurrency, Limit: concurrencyLimit, Window: concurrencyLease,
		},
		keys:   make([]string, nkeys),
		hashed: make([][]byte, nkeys),
	}
	for i := range nkeys {
		w.keys[i] = "key-" + strconv.Itoa(i)
		w.hashed[i] = ratelimit.StoredKey(ratelimit.HashedKeys, concurrencyName, w.keys[i])
	}
	return w
}

// populate makes every key's row, so that the measured acquires update
// existing rows: an acquire statement per key, for a slot that lapses a
// microsecond later.
func (w concurrencyWorkload) populate(ctx context.Context, pool *pgxpool.Pool) error {
	q := gen.New()
	token := make([]byte, 16)
	if _, err := rand.Read(token); err != nil {
		return err
	}
	for start := 0; start < len(w.keys); start += populateBatch {
		b := &pgx.Batch{}
		for k := start; k < min(start+populateBatch, len(w.keys)); k++ {
			if _, err := q.ConcurrencyAcquire(ctx, batchDB{b}, gen.ConcurrencyAcquireParams{
				Key: w.hashed[k], Token: token, TtlUs: 1, MaxHeld: concurrencyLimit,
			}); err != nil {
				return err
			}
		}
		if err := pool.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("populate concurrency keys: %w", err)
		}
	}
	return nil
}

// acquireMeter keeps the latency of each acquire alone (the path's own
// latency is the acquire and its release), of the measured slices only.
type acquireMeter struct {
	mu    sync.Mutex
	slice []int64
	path  loadtest.Path // Latencies: the measured acquires
}

func (m *acquireMeter) Start(context.Context) {
	m.mu.Lock()
	m.slice = m.slice[:0]
	m.mu.Unlock()
}

func (m *acquireMeter) Stop(_ context.Context, measured bool) {
	m.mu.Lock()
	if measured {
		m.path.Latencies = append(m.path.Latencies, m.slice...)
	}
	m.slice = m.slice[:0]
	m.mu.Unlock()
}

func (m *acquireMeter) add(d time.Duration) {
	m.mu.Lock()
	m.slice = append(m.slice, d.Nanoseconds())
	m.mu.Unlock()
}

// percentileUs is the q-quantile of the measured acquires in µs.
func (m *acquireMeter) percentileUs(q float64) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	slices.Sort(m.path.Latencies)
	return m.path.PercentileUs(q)
}

// runConcurrencyCase measures, at one number of callers over nkeys keys,
// an acquire and its release against a fixed-window check, both through
// one Database with the library's default configuration.
func runConcurrencyCase(ctx context.Context, o options, connString string, fw workload, cw concurrencyWorkload, callers, nkeys int) (ConcurrencyCase, error) {
	pool, err := openPool(ctx, connString, o.schema, callers)
	if err != nil {
		return ConcurrencyCase{}, err
	}
	defer pool.Close()
	rdb, err := ratelimit.NewDatabase(pool, fw.dbOpts)
	if err != nil {
		return ConcurrencyCase{}, err
	}
	allowL, err := rdb.Limiter(fw.cfg)
	if err != nil {
		return ConcurrencyCase{}, err
	}
	acquireL, err := rdb.Limiter(cw.cfg)
	if err != nil {
		return ConcurrencyCase{}, err
	}
	var allowFallbacks, acquireFallbacks atomic.Int64
	meter := &acquireMeter{}
	allow := &loadtest.Path{Name: "fixed-window allow", Check: func(ctx context.Context, k int) error {
		d, err := allowL.Allow(ctx, fw.keys[k])
		if err != nil {
			return err
		}
		if !d.Allowed {
			return fmt.Errorf("check of %q denied with a limit of %d: the benchmark measures admitted checks", fw.keys[k], benchLimit)
		}
		if d.Store != ratelimit.StorePostgres {
			allowFallbacks.Add(1)
		}
		return nil
	}}
	acquire := &loadtest.Path{Name: "acquire and release", Meter: meter, Check: func(ctx context.Context, k int) error {
		t0 := time.Now()
		slot, d, err := acquireL.Acquire(ctx, cw.keys[k])
		took := time.Since(t0)
		if err != nil {
			return err
		}
		if !d.Allowed {
			return fmt.Errorf("acquire of %q refused with a limit of %d slots: the benchmark measures granted acquires", cw.keys[k], concurrencyLimit)
		}
		if d.Store != ratelimit.StorePostgres {
			acquireFallbacks.Add(1)
		}
		meter.add(took)
		return slot.Release(ctx)
	}}
	plan := loadtest.Plan{Callers: callers, Keys: nkeys, Warmup: o.warmup, Duration: o.duration, Slice: sliceTarget}
	if err := loadtest.Run(ctx, plan, allow, acquire); err != nil {
		return ConcurrencyCase{}, err
	}
	c := ConcurrencyCase{
		Callers:             callers,
		Keys:                nkeys,
		AllowChecks:         allow.Checks(),
		Acquires:            acquire.Checks(),
		AllowOpsPerSec:      loadtest.Round(allow.OpsPerSec(), 1),
		AcquireOpsPerSec:    loadtest.Round(acquire.OpsPerSec(), 1),
		AllowP50Us:          loadtest.Round(allow.PercentileUs(0.50), 1),
		AllowP99Us:          loadtest.Round(allow.PercentileUs(0.99), 1),
		AcquireP50Us:        loadtest.Round(meter.percentileUs(0.50), 1),
		AcquireP99Us:        loadtest.Round(meter.percentileUs(0.99), 1),
		AcquireReleaseP50Us: loadtest.Round(acquire.PercentileUs(0.50), 1),
		AcquireReleaseP99Us: loadtest.Round(acquire.PercentileUs(0.99), 1),
		AllowFallbacks:      allowFallbacks.Load(),
		AcquireFallbacks:    acquireFallbacks.Load(),
	}
	c.AcquireP50Ratio = loadtest.Ratio(meter.percentileUs(0.50), allow.PercentileUs(0.50))
	c.AcquireReleaseP50Ratio = loadtest.Ratio(acquire.PercentileUs(0.50), allow.PercentileUs(0.50))
	return c, nil
}

// renewStatement begins the SQL text of the statement that extends the
// slots a Database holds (gen.Queries.ConcurrencyRenew).
const renewStatement = "-- name: ConcurrencyRenew "

// renewal is one extension statement a Database sent.
type renewal struct {
	sent time.Time
	took time.Duration
	keys int // distinct keys: the rows it writes
	err  error
}

// countingDB is the DB of a Database whose extension statements are
// counted: it passes every statement on to its pool and records when
// each extension was sent, how long it took and how many keys it named.
type countingDB struct {
	*pgxpool.Pool
	mu       sync.Mutex
	renewals []renewal
}

// Query runs a query, recording it when it is an extension.
func (c *countingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !strings.HasPrefix(sql, renewStatement) {
		return c.Pool.Query(ctx, sql, args...)
	}
	r := renewal{sent: time.Now(), keys: -1}
	if len(args) > 1 {
		if keys, ok := args[1].([][]byte); ok {
			distinct := map[string]bool{}
			for _, k := range keys {
				distinct[string(k)] = true
			}
			r.keys = len(distinct)
		}
	}
	rows, err := c.Pool.Query(ctx, sql, args...)
	if err != nil {
		r.took, r.err = time.Since(r.sent), err
		c.record(r)
		return nil, err
	}
	return &timedRows{Rows: rows, done: func(err error) {
		r.took, r.err = time.Since(r.sent), err
		c.record(r)
	}}, nil
}

func (c *countingDB) record(r renewal) {
	c.mu.Lock()
	c.renewals = append(c.renewals, r)
	c.mu.Unlock()
}

func (c *countingDB) all() []renewal {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.renewals)
}

// timedRows calls done once, when the rows are closed: the statement has
// then ended.
type timedRows struct {
	pgx.Rows
	done func(error)
	once sync.Once
}

func (r *timedRows) Close() {
	r.Rows.Close()
	r.once.Do(func() { r.done(r.Rows.Err()) })
}

// holdGroup is one number of slots, held by a Database of its own.
type holdGroup struct {
	slots, keys int
	db          *countingDB
	first       time.Time // the first acquire
	released    time.Time // the first release
	lost        int
}

// hold acquires g.slots slots over g.keys keys, holds them for holdFor
// from the first acquire, and releases them.
func (g *holdGroup) hold(ctx context.Context, window, holdFor time.Duration) error {
	rdb, err := ratelimit.NewDatabase(g.db, ratelimit.DatabaseOptions{})
	if err != nil {
		return err
	}
	perKey := (g.slots + g.keys - 1) / g.keys
	l, err := rdb.Limiter(ratelimit.Config{
		Name: "rl-bench-hold-" + strconv.Itoa(g.slots), Algorithm: ratelimit.Concurrency, Limit: int64(perKey), Window: window,
	})
	if err != nil {
		return err
	}
	held := make([]*ratelimit.Slot, 0, g.slots)
	defer func() {
		for _, s := range held {
			_ = s.Release(context.WithoutCancel(ctx))
		}
	}()
	g.first = time.Now()
	for i := range g.slots {
		s, d, err := l.Acquire(ctx, "hold-"+strconv.Itoa(i%g.keys))
		if err != nil {
			return err
		}
		if !d.Allowed || d.Store != ratelimit.StorePostgres {
			return fmt.Errorf("slot %d of %d not taken in PostgreSQL (allowed %v, store %s)", i+1, g.slots, d.Allowed, d.Store)
		}
		held = append(held, s)
	}
	select {
	case <-time.After(time.Until(g.first.Add(holdFor))):
	case <-ctx.Done():
		return ctx.Err()
	}
	g.released = time.Now()
	for _, s := range held {
		if s.Err() != nil {
			g.lost++
		}
	}
	for _, s := range held {
		if err := s.Release(ctx); err != nil {
			return err
		}
	}
	held = nil
	return nil
}

// result sums up the group's extensions during the hold.
func (g *holdGroup) result(window time.Duration) HoldCase {
	interval := window / 3
	held := g.released.Sub(g.first)
	c := HoldCase{
		Slots:                    g.slots,
		Keys:                     g.keys,
		HeldSeconds:              loadtest.Round(held.Seconds(), 3),
		ExpectedStatements:       int(held / interval),
		ExpectedPerSlotPerMinute: loadtest.Round(3/window.Minutes()/float64(g.slots), 6),
		Lost:                     g.lost,
	}
	var during []renewal
	var took []int64
	for _, r := range g.db.all() {
		if !r.sent.Before(g.first) && r.sent.Before(g.released) {
			during = append(during, r)
			took = append(took, r.took.Nanoseconds())
		}
	}
	c.Statements = len(during)
	switch {
	case len(during) >= 2:
		span := during[len(during)-1].sent.Sub(during[0].sent)
		c.StatementsPerMinute = loadtest.Round(float64(len(during)-1)/span.Minutes(), 3)
	case len(during) == 1:
		c.StatementsPerMinute = loadtest.Round(1/held.Minutes(), 3)
	}
	c.PerSlotPerMinute = loadtest.Round(c.StatementsPerMinute/float64(g.slots), 6)
	if len(took) > 0 {
		slices.Sort(took)
		p := loadtest.Path{Latencies: took}
		c.StatementP50Ms = loadtest.Round(p.PercentileUs(0.5)/1e3, 2)
		c.StatementMaxMs = loadtest.Round(p.PercentileUs(1)/1e3, 2)
	}
	return c
}

// runHolds holds every number of slots of o.holdSlots at once, each group
// on a pool and a Database of its own, and counts their extensions three
// ways: as they go through the Databases' DB, in the rows of
// pgrl_concurrency written meanwhile, and in pg_stat_statements when the
// database has it loaded.
func runHolds(ctx context.Context, o options, connString string, admin *pgx.Conn, versionNum int, log io.Writer) (*HoldReport, error) {
	rep := &HoldReport{
		WindowSeconds:   o.holdWindow.Seconds(),
		IntervalSeconds: (o.holdWindow / 3).Seconds(),
		HoldSeconds:     o.holdFor.Seconds(),
	}
	writesBefore, err := settledConcurrencyWrites(ctx, admin, o.schema, versionNum)
	if err != nil {
		return nil, err
	}
	callsBefore, why := renewCalls(ctx, admin)

	groups := make([]*holdGroup, len(o.holdSlots))
	for i, n := range o.holdSlots {
		pool, err := openPool(ctx, connString, o.schema, 2)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		groups[i] = &holdGroup{slots: n, keys: min(n, o.holdKeys), db: &countingDB{Pool: pool}}
	}
	fmt.Fprintf(log, "rl-bench: holding %v slots for %v, Window %v\n", o.holdSlots, o.holdFor, o.holdWindow)
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for i, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := g.hold(ctx, o.holdWindow, o.holdFor); err != nil {
				errs[i] = fmt.Errorf("holding %d slots: %w", g.slots, err)
			}
		}()
	}
	wg.Wait()
	for _, g := range groups {
		g.db.Close()
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}

	for _, g := range groups {
		rep.Cases = append(rep.Cases, g.result(o.holdWindow))
		rep.ExpectedRowWrites += 2 * int64(g.slots) // each acquire and each release
		for _, r := range g.db.all() {
			rep.Statements++
			if r.err == nil && r.keys > 0 {
				rep.ExpectedRowWrites += int64(r.keys)
			}
		}
	}
	writesAfter, err := settledConcurrencyWrites(ctx, admin, o.schema, versionNum)
	if err != nil {
		return nil, err
	}
	rep.RowWrites = writesAfter - writesBefore
	if why == "" {
		callsAfter, whyAfter := renewCalls(ctx, admin)
		if whyAfter == "" {
			n := callsAfter - callsBefore
			rep.PgStatStatementsCalls = &n
			rep.PgStatStatements = "calls of the extension statement in this database, by any session"
		} else {
			why = whyAfter
		}
	}
	if why != "" {
		rep.PgStatStatements = "not read: " + why
	}
	return rep, nil
}

// concurrencyWrites reads the rows of pgrl_concurrency in schema inserted
// and updated so far.
func concurrencyWrites(ctx context.Context, conn *pgx.Conn, schema string) (int64, error) {
	var n int64
	err := conn.QueryRow(ctx, `
		SELECT coalesce(sum(n_tup_ins + n_tup_upd), 0)::bigint
		  FROM pg_stat_user_tables
		 WHERE schemaname = $1 AND relname = 'pgrl_concurrency'`, schema).Scan(&n)
	return n, err
}

// settledConcurrencyWrites is concurrencyWrites once the backends that
// wrote have reported (see settledTableStats).
func settledConcurrencyWrites(ctx context.Context, conn *pgx.Conn, schema string, versionNum int) (int64, error) {
	if versionNum >= 150000 {
		if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			return 0, err
		}
	}
	prev, err := concurrencyWrites(ctx, conn, schema)
	if err != nil {
		return 0, err
	}
	for range 20 {
		select {
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		cur, err := concurrencyWrites(ctx, conn, schema)
		if err != nil {
			return 0, err
		}
		if cur == prev {
			return cur, nil
		}
		prev = cur
	}
	return prev, nil
}

// renewCalls reads from pg_stat_statements how many times this database
// ran the extension statement, or says why it cannot.
func renewCalls(ctx context.Context, conn *pgx.Conn) (int64, string) {
	var schema string
	err := conn.QueryRow(ctx, `
		SELECT n.nspname FROM pg_catalog.pg_extension AS e
		  JOIN pg_catalog.pg_namespace AS n ON n.oid = e.extnamespace
		 WHERE e.extname = 'pg_stat_statements'`).Scan(&schema)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, "the pg_stat_statements extension is not created in this database"
	}
	if err != nil {
		return 0, err.Error()
	}
	var n int64
	err = conn.QueryRow(ctx, `
		SELECT coalesce(sum(s.calls), 0)::bigint
		  FROM `+pgx.Identifier{schema, "pg_stat_statements"}.Sanitize()+` AS s
		 WHERE s.dbid = (SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname = current_database())
		   AND s.query LIKE '%pgrl_concurrency_renew(%'`).Scan(&n)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return 0, pgErr.Message
		}
		return 0, err.Error()
	}
	return n, ""
}

// benchmarkConcurrency runs the --concurrency cases and the hold, into rep.
func benchmarkConcurrency(ctx context.Context, o options, connString string, admin *pgx.Conn, versionNum int, rep *Report, log io.Writer) error {
	maxKeys := slices.Max(o.keys)
	fw := newWorkload(ratelimit.FixedWindow, maxKeys, o)
	cw := newConcurrencyWorkload(maxKeys)
	pool, err := openPool(ctx, connString, o.schema, 1)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "rl-bench: fixed_window and concurrency: touching %d keys\n", maxKeys)
	err = fw.populate(ctx, pool)
	if err == nil {
		err = cw.populate(ctx, pool)
	}
	pool.Close()
	if err != nil {
		return err
	}
	for _, callers := range o.callers {
		for _, nkeys := range o.keys {
			fmt.Fprintf(log, "rl-bench: concurrency, %d callers, %d keys: acquire and release, and fixed-window allow, %v each\n",
				callers, nkeys, o.duration)
			c, err := runConcurrencyCase(ctx, o, connString, fw, cw, callers, nkeys)
			if err != nil {
				return fmt.Errorf("concurrency, %d callers, %d keys: %w", callers, nkeys, err)
			}
			rep.ConcurrencyCases = append(rep.ConcurrencyCases, c)
		}
	}
	if o.holdFor > 0 {
		h, err := runHolds(ctx, o, connString, admin, versionNum, log)
		if err != nil {
			return err
		}
		rep.Holds = h
	}
	return nil
}
