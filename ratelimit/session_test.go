package ratelimit_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// hostileSettings are session settings a role or a connection string may
// carry. None of them may change a decision.
var hostileSettings = []map[string]string{
	{"DateStyle": "SQL, DMY", "IntervalStyle": "postgres_verbose", "TimeZone": "Pacific/Chatham", "extra_float_digits": "-15"},
	{"DateStyle": "German, DMY", "IntervalStyle": "sql_standard", "TimeZone": "-14", "extra_float_digits": "3"},
	{"DateStyle": "Postgres, DMY", "IntervalStyle": "iso_8601", "TimeZone": "America/St_Johns", "extra_float_digits": "0", "bytea_output": "escape"},
}

var execModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// sessionScript runs the same checks (every algorithm, costs, penalty, a
// pinned clock moving through fractional refills, Peek, Reset, AllowAll and
// the coalesced statement) and returns what a caller would see, as text.
func sessionScript(t *testing.T, db *pgxpool.Pool) []string {
	ctx := context.Background()
	var out []string
	now := base.Add(1234567 * time.Microsecond)
	clk := func() time.Time { return now }
	record := func(what string, d ratelimit.Decision, err error) {
		require.NoError(t, err, what)
		require.NotEqual(t, ratelimit.StoreMemory, d.Store, "%s answered from memory: %s", what, d.Reason)
		out = append(out, fmt.Sprintf("%s: allowed=%v limit=%d remaining=%d reset=%s retry=%v store=%s",
			what, d.Allowed, d.Limit, d.Remaining, d.ResetAt.UTC().Format(time.RFC3339Nano), d.RetryAfter, d.Store))
	}
	var ls []*ratelimit.Limiter
	// One Database: the limits of one AllowAll below.
	limits := testkit.NewDatabase(t, db, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout, Now: clk})
	for _, alg := range ratelimit.Algorithms {
		for _, penalty := range []bool{false, true} {
			l := testkit.Limiter(t, limits, ratelimit.Config{Name: fmt.Sprintf("s-%s-%v", alg, penalty), Algorithm: alg, Limit: 3, Burst: 5, Window: 7 * time.Second, Penalty: penalty, DenyCacheSize: -1})
			ls = append(ls, l)
			for i, step := range []time.Duration{0, 0, 1100 * time.Millisecond, 0, 2333333 * time.Microsecond, 7 * time.Second, 0} {
				now = now.Add(step)
				d, err := l.Allow(ctx, "k", ratelimit.Cost(int64(1+i%2)))
				record(fmt.Sprintf("%s penalty=%v check %d", alg, penalty, i), d, err)
				p, err := l.Peek(ctx, "k")
				record(fmt.Sprintf("%s penalty=%v peek %d", alg, penalty, i), p, err)
			}
			ds, err := ratelimit.TakeMany(ctx, l, []string{"k", "m", "\x00\xff"}, []int64{1, 2, 3})
			require.NoError(t, err)
			for i, d := range ds {
				record(fmt.Sprintf("%s penalty=%v batch %d", alg, penalty, i), d, nil)
			}
			require.NoError(t, l.Reset(ctx, "k"))
			d, err := l.Allow(ctx, "k")
			record(fmt.Sprintf("%s penalty=%v after reset", alg, penalty), d, err)
		}
	}
	for _, mode := range []ratelimit.MultiMode{ratelimit.AllOrNothing, ratelimit.ConsumeAll} {
		for i := range 3 {
			now = now.Add(900 * time.Millisecond)
			var checks []ratelimit.Check
			for _, l := range ls {
				checks = append(checks, ratelimit.Check{Limiter: l, Key: "multi", Cost: 2})
			}
			m, err := ratelimit.AllowAll(ctx, mode, checks...)
			require.NoError(t, err)
			for j, d := range m.Decisions {
				record(fmt.Sprintf("multi %d/%d check %d", mode, i, j), d, nil)
			}
		}
	}
	// The database's own clock, in the hostile session's time zone.
	for _, alg := range ratelimit.Algorithms {
		l, err := testkit.New(db, ratelimit.Config{Name: "live", Algorithm: alg, Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Timeout: testkit.DecisionTimeout})
		require.NoError(t, err)
		d, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, ratelimit.StorePostgres, d.Store, "%s: %s", alg, d.Reason)
		require.WithinDuration(t, time.Now(), d.Now, time.Minute)
		require.True(t, d.ResetAt.After(d.Now))
	}
	return out
}

// TestHostileSessionSettings: every pgx exec mode under hostile DateStyle,
// IntervalStyle, TimeZone, extra_float_digits, bytea_output and a
// search_path on which pgrl's schema is not first decides exactly as a
// clean session does.
func TestHostileSessionSettings(t *testing.T) {
	t.Parallel()
	clean, _ := dbtest.Pool(t)
	want := sessionScript(t, clean)
	for si, settings := range hostileSettings {
		for _, mode := range execModes {
			t.Run(fmt.Sprintf("settings%d/%v", si, mode), func(t *testing.T) {
				_, schema := dbtest.Pool(t)
				decoy := dbtest.NewSchema(t)
				pool := dbtest.PoolOn(t, schema, dbtest.WithExecMode(mode), func(c *pgxpool.Config) {
					for k, v := range settings {
						c.ConnConfig.RuntimeParams[k] = v
					}
					c.ConnConfig.RuntimeParams["search_path"] = decoy + ", " + schema
				})
				var ds string
				require.NoError(t, pool.QueryRow(context.Background(), "SHOW DateStyle").Scan(&ds))
				require.Equal(t, settings["DateStyle"], ds)
				require.Equal(t, want, sessionScript(t, pool))
			})
		}
	}
}
