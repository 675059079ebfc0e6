package tests

// Session settings must not change what the policy, cleanup and migration
// packages read or decide, in any pgx exec mode: ratelimit's own statements
// are held to that in ratelimit/session_test.go, these are the rest.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/cleanup"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/migration"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// sessionHostile are session settings a role, a database or a connection
// string may carry. None may change what any package reads.
var sessionHostile = []map[string]string{
	{"DateStyle": "SQL, DMY", "IntervalStyle": "postgres_verbose", "TimeZone": "Pacific/Chatham", "extra_float_digits": "-15"},
	{"DateStyle": "German, DMY", "IntervalStyle": "sql_standard", "TimeZone": "-14", "extra_float_digits": "3"},
	{"DateStyle": "Postgres, DMY", "IntervalStyle": "iso_8601", "TimeZone": "Asia/Kolkata", "extra_float_digits": "0"},
	{"DateStyle": "SQL, MDY", "IntervalStyle": "iso_8601", "TimeZone": "America/St_Johns", "extra_float_digits": "-15"},
}

var sessionExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// sessionURL is the test database's URL with the exec mode and the
// settings as connection parameters (what a user's DATABASE_URL would
// carry), and a search_path on which an empty decoy schema comes before
// schemaName.
func sessionURL(schemaName, decoy string, mode pgx.QueryExecMode, settings map[string]string) string {
	u := dbtest.URLWithSchema(decoy + ", " + schemaName)
	u = strings.ReplaceAll(u, ", ", "%2C%20") + "&default_query_exec_mode=" + strings.ReplaceAll(mode.String(), " ", "_")
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		u += "&" + k + "=" + strings.ReplaceAll(url.QueryEscape(settings[k]), "+", "%20")
	}
	return u
}

// sessionScript runs policy, cleanup and migration operations on a fresh
// schema through connections made from connURL, and returns what a caller
// sees, as text. Instants that depend on the clock are checked here against
// the clock (and against the same rows read by a clean session) instead of
// being returned.
func sessionScript(t *testing.T, schemaName, connURL string) []string {
	ctx := context.Background()
	admin := dbtest.Admin(t)
	qs := pgx.Identifier{schemaName}.Sanitize()
	var out []string
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	near := func(what string, got time.Time) {
		require.WithinDuration(t, time.Now(), got, 5*time.Minute, "%s: %s", what, got)
	}

	// Migration.
	connCfg, err := pgx.ParseConfig(connURL)
	require.NoError(t, err)
	m, err := migration.NewWithConnConfig(connCfg, migration.Config{Schema: schemaName, PartitionLookahead: 3 * time.Hour})
	require.NoError(t, err)
	defer func() { _ = m.Close() }()
	res, err := m.Up(ctx)
	require.NoError(t, err, "migration up")
	add("up %d -> %d", res.From, res.To)
	res, err = m.Down(ctx, 1)
	require.NoError(t, err, "migration down")
	add("down %d -> %d", res.From, res.To)
	res, err = m.Up(ctx)
	require.NoError(t, err, "migration up again")
	add("up %d -> %d", res.From, res.To)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	add("status version=%d dirty=%v layout=%s width=%s", st.Version, st.Dirty, st.Layout, st.PartitionWidth)

	poolCfg, err := pgxpool.ParseConfig(connURL)
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	require.NoError(t, err)
	defer pool.Close()
	for _, k := range []string{"DateStyle", "IntervalStyle", "extra_float_digits"} {
		var v string
		require.NoError(t, pool.QueryRow(ctx, "SELECT current_setting($1)", k).Scan(&v))
		if q, err := url.ParseQuery(strings.SplitN(connURL, "?", 2)[1]); err == nil && q.Get(k) != "" {
			require.Equal(t, q.Get(k), v, "the session does not have the %s asked for", k)
		}
	}

	// Policies, written by the package and by a DBA in plain SQL (with
	// days in an interval, which the package never writes itself).
	showPolicy := func(what string, p policy.Policy) {
		add("%s: %s %s limit=%d window=%s burst=%d penalty=%v keys=%d desc=%q", what, p.Name, p.Algorithm, p.Limit,
			p.Window, p.Burst, p.Penalty, p.KeyMode, p.Description)
		near(what+" created_at", p.CreatedAt)
		require.False(t, p.UpdatedAt.Before(p.CreatedAt), "%s: updated_at %s before created_at %s", what, p.UpdatedAt, p.CreatedAt)
	}
	// A long window with a fraction of a second: the limiter's checks
	// below and the cleanup after them expect to share one window, which a
	// window of a minute or two ended between them now and then.
	p, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 5, Window: 25*time.Hour + 1500*time.Microsecond,
		Description: "d"})
	require.NoError(t, err, "policy.Set")
	showPolicy("set api", p)
	p, err = policy.Set(ctx, pool, policy.Policy{Name: "tb", Algorithm: ratelimit.TokenBucket, Limit: 10, Window: 36 * time.Hour,
		Burst: 20, Penalty: true, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err, "policy.Set")
	showPolicy("set tb", p)
	_, err = admin.Exec(ctx, `INSERT INTO `+qs+`.pgrl_policy (name, "limit", "window") VALUES ('dba', 3, interval '2 days 03:04:05.678901')`)
	require.NoError(t, err)
	p, err = policy.Get(ctx, pool, "dba")
	require.NoError(t, err, "policy.Get")
	showPolicy("get dba", p)
	ps, err := policy.List(ctx, pool)
	require.NoError(t, err, "policy.List")
	for _, p := range ps {
		showPolicy("list", p)
	}

	// Overrides: one with an expiry far ahead, one expiring in an hour, and
	// one a DBA wrote that has expired.
	api, err := policy.Get(ctx, pool, "api")
	require.NoError(t, err)
	far := time.Date(2099, 3, 4, 5, 6, 7, 123456000, time.UTC)
	o, err := policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: api.StoredKey("k1"), Limit: 7, Window: 2 * time.Hour,
		ExpiresAt: far, Note: "n"})
	require.NoError(t, err, "policy.SetOverride")
	require.True(t, o.ExpiresAt.Equal(far), "SetOverride returned expires_at %s, want %s", o.ExpiresAt, far)
	soon := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	o, err = policy.SetOverride(ctx, pool, policy.Override{Policy: "api", Key: api.StoredKey("k3"), Burst: 9, ExpiresAt: soon})
	require.NoError(t, err, "policy.SetOverride")
	require.True(t, o.ExpiresAt.Equal(soon), "SetOverride returned expires_at %s, want %s", o.ExpiresAt, soon)
	_, err = admin.Exec(ctx, `INSERT INTO `+qs+`.pgrl_policy_override (policy, key, "limit", "window", expires_at)
		VALUES ('api', `+qs+`.pgrl_policy_key('api', 'k2'), 2, interval '1 day 00:00:00.5', now() - interval '1 minute')`)
	require.NoError(t, err)
	ovs, err := policy.ListOverrides(ctx, pool, "")
	require.NoError(t, err, "policy.ListOverrides")
	for _, o := range ovs {
		exp := "never"
		switch {
		case o.ExpiresAt.Equal(far):
			exp = "far"
		case o.ExpiresAt.Equal(soon):
			exp = "soon"
		case !o.ExpiresAt.IsZero():
			near("expired override", o.ExpiresAt)
			exp = "past"
		}
		add("override %s %x limit=%d window=%s burst=%d expires=%s note=%q", o.Policy, o.Key, o.Limit, o.Window, o.Burst, exp, o.Note)
		near("override created_at", o.CreatedAt)
		near("override updated_at", o.UpdatedAt)
	}
	for _, k := range []string{"k1", "k2", "k4"} {
		x, err := policy.Explain(ctx, pool, "api", k)
		require.NoError(t, err, "policy.Explain %s", k)
		add("explain %s: override=%v expired=%v ignored=%q rate=%+v allowed=%v limit=%d remaining=%d", k, x.Override != nil,
			x.Expired != nil, x.Ignored, x.Rate, x.Counter.Allowed, x.Counter.Limit, x.Counter.Remaining)
	}

	// Limiters, with their caches, in both ways of reading the policy.
	for _, fromCache := range []bool{false, true} {
		l, err := policy.NewLimiter(ctx, pool, "api", policy.Options{FromCache: fromCache,
			Config: ratelimit.Config{OnFailure: ratelimit.FailError, DenyCacheSize: -1}})
		require.NoError(t, err, "policy.NewLimiter")
		for _, k := range []string{"k1", "k2", "k3"} {
			for i := range 2 {
				d, err := l.Allow(ctx, fmt.Sprintf("%s-%v", k, fromCache))
				require.NoError(t, err)
				add("limiter fromCache=%v %s #%d: allowed=%v limit=%d remaining=%d store=%s", fromCache, k, i, d.Allowed, d.Limit,
					d.Remaining, d.Store)
			}
		}
	}
	c := policy.NewCache(pool)
	require.NoError(t, c.Reload(ctx), "Cache.Reload")
	np, no := c.Size()
	add("cache: %d policies, %d overrides in force", np, no)
	require.NoError(t, c.ReloadPolicy(ctx, "dba"), "Cache.ReloadPolicy")
	cp, ok := c.Policy("dba")
	require.True(t, ok)
	showPolicy("cached dba", cp)
	require.NoError(t, c.ReloadOverrides(ctx, "api", [][]byte{api.StoredKey("k1"), api.StoredKey("k2")}), "Cache.ReloadOverrides")

	// A listener on such a session (with shared denials, which compare the
	// clocks) applies a change.
	lc := policy.NewCache(pool)
	lis, err := policy.Watch(ctx, connURL, lc, policy.ListenerOptions{Denials: true, MinBackoff: time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	require.NoError(t, err, "policy.Watch")
	defer func() { _ = lis.Close() }()
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	require.NoError(t, lis.WaitSynced(wctx), "listener sync")
	_, err = admin.Exec(ctx, `UPDATE `+qs+`.pgrl_policy SET "window" = interval '1 day 00:00:01' WHERE name = 'dba'`)
	require.NoError(t, err)
	for {
		if p, ok := lc.Policy("dba"); ok && p.Window == 24*time.Hour+time.Second {
			break
		}
		require.NoError(t, wctx.Err(), "the listener never applied the change: %+v", lis.Stats())
		time.Sleep(5 * time.Millisecond)
	}
	ls := lis.Stats()
	require.Zero(t, ls.Reconnects, "the listener reconnected: %s", ls.LastError)
	require.Empty(t, ls.LastError)
	add("listener applied the change")

	// Cleanup in delete mode: dead and live rows in every table.
	_, err = admin.Exec(ctx, `
INSERT INTO `+qs+`.pgrl_fixed_window (key, expires_at, count, allowed)
VALUES ('\x01', now() - interval '1 hour', 1, true), ('\x02', now() + interval '1 hour', 1, true);
INSERT INTO `+qs+`.pgrl_token_bucket (key, tokens, updated_at, full_at, allowed)
VALUES ('\x01', 1, now() - interval '2 hours', now() - interval '1 hour', true),
       ('\x02', 1, now(), now() + interval '1 hour', true);
INSERT INTO `+qs+`.pgrl_sliding_window (key, window_start, count, prev_count, expires_at, allowed)
VALUES ('\x01', now() - interval '3 hours', 1, 0, now() - interval '1 hour', true),
       ('\x02', now(), 1, 0, now() + interval '1 hour', true)`)
	require.NoError(t, err)
	showCleanup := func(what string, r cleanup.Result) {
		add("%s: fixed=%d/%d token=%d/%d sliding=%d/%d skipped=%v stopped=%v", what,
			r.Tables.FixedWindow.Deleted, r.Tables.FixedWindow.WouldDelete, r.Tables.TokenBucket.Deleted, r.Tables.TokenBucket.WouldDelete,
			r.Tables.SlidingWindow.Deleted, r.Tables.SlidingWindow.WouldDelete, r.Skipped, r.StoppedEarly)
	}
	pinned := time.Now().Add(-90 * time.Minute).Truncate(time.Microsecond)
	r, err := cleanup.Run(ctx, pool, cleanup.Options{DryRun: true, At: &pinned})
	require.NoError(t, err, "cleanup.Run pinned")
	require.True(t, r.Cutoff.Equal(pinned))
	showCleanup("cleanup dry run, pinned before the dead rows", r)
	r, err = cleanup.Run(ctx, pool, cleanup.Options{DryRun: true})
	require.NoError(t, err, "cleanup.Run dry")
	near("cleanup cutoff", r.Cutoff)
	showCleanup("cleanup dry run", r)
	r, err = cleanup.Run(ctx, pool, cleanup.Options{})
	require.NoError(t, err, "cleanup.Run")
	showCleanup("cleanup", r)

	// The partitioned layout: partitions ahead (by the migrator), past
	// ones (made by a clean session), listed and dropped by cleanup.
	layout, err := m.SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err, "SetLayout partitioned")
	add("layout %s", layout)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	add("status layout=%s width=%s", st.Layout, st.PartitionWidth)
	_, err = admin.Exec(ctx, `SELECT `+qs+`.pgrl_fixed_window_ensure_partitions(now() - interval '6 hours', now() - interval '5 hours')`)
	require.NoError(t, err)
	conn, err := pgx.ConnectConfig(ctx, connCfg)
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	got, err := sqlops.New().FixedWindowPartitions(ctx, conn)
	require.NoError(t, err, "FixedWindowPartitions")
	want := partitionBounds(t, schemaName)
	require.Len(t, got, len(want))
	for i, g := range got {
		require.Equal(t, want[i].name, g.PartitionName)
		lower, upper := time.UnixMicro(g.LowerBoundUs), time.UnixMicro(g.UpperBoundUs)
		require.True(t, want[i].lower.Equal(lower) && want[i].upper.Equal(upper),
			"partition %s: read [%s, %s), a clean session reads [%s, %s)", g.PartitionName, lower, upper, want[i].lower, want[i].upper)
	}
	// How many there are depends on the hour the run is in (partitions
	// ahead of now), which may turn between two settings' runs: the
	// transcript says only that each was read as a clean session reads it.
	require.NotEmpty(t, got)
	add("partitions read as a clean session reads them")
	// How many are dropped depends on the hour too (the migrator's
	// partitions behind now): the transcript says only that the one made
	// six hours back went, and that only partitions that existed did.
	before := map[string]bool{}
	for _, b := range partitionBounds(t, schemaName) {
		before[b.name] = true
	}
	created := -1
	var dropped []string
	for _, dry := range []bool{true, false} {
		r, err = cleanup.Run(ctx, pool, cleanup.Options{Mode: cleanup.ModePartitions, Horizon: 5 * time.Hour, DryRun: dry})
		require.NoError(t, err, "cleanup.Run partitions dry=%v", dry)
		if created >= 0 {
			require.Equal(t, created, r.Partitions.Created, "a dry run counted %d partitions to create, the run made %d", created, r.Partitions.Created)
		}
		created = r.Partitions.Created
		require.NotEmpty(t, r.Partitions.Dropped, "cleanup partitions dry=%v dropped nothing", dry)
		for _, name := range r.Partitions.Dropped {
			require.True(t, before[name], "cleanup partitions dry=%v dropped %q, which did not exist", dry, name)
		}
		dropped = r.Partitions.Dropped
		add("cleanup partitions dry=%v: dropped past partitions", dry)
	}
	after := partitionBounds(t, schemaName)
	require.NotEmpty(t, after)
	for _, b := range after {
		require.NotContains(t, dropped, b.name, "cleanup reported %s dropped, and it is still there", b.name)
	}
	require.False(t, after[0].lower.Before(time.Now().Add(-time.Hour)), "a past partition survived: %+v", after[0])
	require.True(t, after[len(after)-1].upper.After(time.Now().Add(5*time.Hour)), "no partition reaches the horizon: %+v", after)
	layout, err = m.SetLayout(ctx, migration.LayoutPlain, 0)
	require.NoError(t, err, "SetLayout plain")
	add("layout %s", layout)
	return out
}

// TestSessionSettingsEveryPackage: under every pgx exec mode and hostile
// DateStyle, IntervalStyle, TimeZone and extra_float_digits, the policy,
// cleanup and migration packages read and do exactly what they do in a clean
// session.
func TestSessionSettingsEveryPackage(t *testing.T) {
	t.Parallel()
	clean := dbtest.NewSchema(t)
	want := sessionScript(t, clean, dbtest.URLWithSchema(clean))
	for si, settings := range sessionHostile {
		for _, mode := range sessionExecModes {
			t.Run(fmt.Sprintf("settings%d/%v", si, mode), func(t *testing.T) {
				s := dbtest.NewSchema(t)
				got := sessionScript(t, s, sessionURL(s, dbtest.NewSchema(t), mode, settings))
				require.Equal(t, strings.Join(want, "\n"), strings.Join(got, "\n"))
			})
		}
	}
}

// TestSessionSettingsCommands: rl-migrate, rl-policy and rl-cleanup, given a
// DATABASE_URL with a hostile exec mode and session settings, do what they
// do in a clean session.
func TestSessionSettingsCommands(t *testing.T) {
	t.Parallel()
	migrate := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-migrate")
	pol := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-policy")
	clean := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-cleanup")
	script := func(t *testing.T, connURL, schemaName string) []string {
		var out []string
		run := func(bin string, args ...string) string {
			args = append([]string{"--database-url", connURL, "--schema", schemaName}, args...)
			cmd := exec.Command(bin, args...)
			cmd.Env = append(os.Environ(), "DATABASE_URL=", "PGHOST=")
			b, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s %s:\n%s", filepath.Base(bin), strings.Join(args[4:], " "), b)
			return string(b)
		}
		var res struct {
			Policies []struct {
				Name   string `json:"name"`
				Limit  int64  `json:"limit"`
				Window string `json:"window"`
			} `json:"policies"`
		}
		run(migrate, "up")
		run(pol, "set", "api", "--limit", "5", "--window", "90s")
		run(pol, "override", "set", "api", "k1", "--limit", "7", "--window", "2h", "--expires-in", "1h")
		require.NoError(t, json.Unmarshal([]byte(run(pol, "--output", "json", "list")), &res))
		out = append(out, fmt.Sprintf("list: %+v", res.Policies))
		var ovs struct {
			Overrides []struct {
				Limit  int64  `json:"limit"`
				Window string `json:"window"`
			} `json:"overrides"`
		}
		require.NoError(t, json.Unmarshal([]byte(run(pol, "--output", "json", "override", "list")), &ovs))
		out = append(out, fmt.Sprintf("overrides: %+v", ovs.Overrides))
		run(pol, "explain", "api", "k1")
		run(migrate, "layout", "partitioned", "--partition-width", "1h", "--lookahead", "3h")
		run(clean, "--mode", "partitions", "--horizon", "5h")
		run(migrate, "layout", "plain")
		run(clean, "--dry-run")
		return out
	}
	s := dbtest.NewSchema(t)
	want := script(t, dbtest.URL(), s)
	for si, settings := range sessionHostile {
		for _, mode := range sessionExecModes {
			t.Run(fmt.Sprintf("settings%d/%v", si, mode), func(t *testing.T) {
				s := dbtest.NewSchema(t)
				got := script(t, sessionURL(s, dbtest.NewSchema(t), mode, settings), s)
				require.Equal(t, want, got)
			})
		}
	}
}
