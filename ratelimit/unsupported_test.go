package ratelimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// A schema change that makes the fixed window's check statement fail with
// an error of SQLSTATE class 0A or 42 on plain PostgreSQL, and the change
// that undoes it.
type misfit struct {
	name        string
	class       string // the SQLSTATE class the check gets
	peekFails   bool   // Peek (which writes nothing) fails too
	break_, fix string
}

var misfits = []misfit{{
	// What Citus answers for an upsert it cannot run on a distributed
	// table: feature_not_supported (0A000), raised here by a trigger on
	// every write of the counter table.
	name: "feature not supported", class: "0A",
	break_: `CREATE FUNCTION refuse_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'functions used in the DO UPDATE SET clause of INSERTs on distributed tables must be marked IMMUTABLE'
    USING ERRCODE = 'feature_not_supported';
END $$;
CREATE TRIGGER refuse_write BEFORE INSERT OR UPDATE ON pgrl_fixed_window FOR EACH ROW EXECUTE FUNCTION refuse_write()`,
	fix: `DROP TRIGGER refuse_write ON pgrl_fixed_window`,
}, {
	// A schema whose helper function is not the one this version's
	// statements were written for, as when another pgrl version migrated
	// it: pgrl_from_epoch_us returns microseconds instead of a timestamptz,
	// so the insert into expires_at is a datatype mismatch (42804) and
	// Peek's comparison has no operator (42883, naming no pgrl_ function).
	name: "datatype mismatch", class: "42", peekFails: true,
	break_: `DROP FUNCTION pgrl_from_epoch_us(bigint);
CREATE FUNCTION pgrl_from_epoch_us(us bigint) RETURNS bigint LANGUAGE sql IMMUTABLE AS $$ SELECT us $$`,
	fix: `DROP FUNCTION pgrl_from_epoch_us(bigint);
CREATE FUNCTION pgrl_from_epoch_us(us bigint) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT timestamptz 'epoch' + us * interval '1 microsecond' $$`,
}}

// TestUnsupportedNeverReachesTheFailurePolicy: when the check's SQL does not
// fit the server (SQLSTATE class 0A or 42), every failure policy, with and
// without coalescing, single checks, AllowAll and AllowTx alike, returns
// ErrUnsupported with the *pgconn.PgError: no decision from the policy or
// the memory tier, no open breaker however often it happens, and one error
// log per limiter. Once the schema fits again, the next check is counted by
// PostgreSQL.
func TestUnsupportedNeverReachesTheFailurePolicy(t *testing.T) {
	t.Parallel()
	for _, m := range misfits {
		t.Run(m.name, func(t *testing.T) {
			pool, _ := dbtest.Pool(t)
			ctx := context.Background()
			other := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "other", Algorithm: ratelimit.TokenBucket, Limit: 100, Window: time.Hour})
			_, err := pool.Exec(ctx, m.break_)
			require.NoError(t, err)

			type checked struct {
				l    *ratelimit.Limiter
				logs *testkit.LogBuffer
			}
			var limiters []checked
			for _, policy := range []ratelimit.FailurePolicy{ratelimit.FailOpen, ratelimit.FailClosed, ratelimit.FailToMemory} {
				for _, coalesce := range []bool{false, true} {
					name := fmt.Sprintf("%s-coalesce-%v", strings.ReplaceAll(policy.String(), " ", "-"), coalesce)
					logs := &testkit.LogBuffer{}
					l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: name, Limit: 100, Window: time.Hour, OnFailure: policy}, ratelimit.DatabaseOptions{DisableCoalescing: !coalesce, Logger: slog.New(slog.NewTextHandler(logs, nil))})
					require.Equal(t, coalesce, ratelimit.Coalesces(l))
					misfit := func(what string, d ratelimit.Decision, err error) {
						t.Helper()
						require.ErrorIs(t, err, ratelimit.ErrUnsupported, "%s %s: decision %+v", name, what, d)
						var pgErr *pgconn.PgError
						require.ErrorAs(t, err, &pgErr, "%s %s", name, what)
						require.Equal(t, m.class, pgErr.Code[:2], "%s %s: %v", name, what, pgErr)
						require.Empty(t, d.Store, "%s %s: no store answered", name, what)
						require.False(t, d.Allowed, "%s %s", name, what)
					}
					threshold := ratelimit.OptionsOf(l).BreakerThreshold
					for i := range 3 * threshold {
						d, err := l.Allow(ctx, fmt.Sprint("k", i%3))
						misfit("Allow", d, err)
					}
					if coalesce {
						// Concurrent checks, which the coalescer may send as
						// one statement.
						var wg sync.WaitGroup
						ds := make([]ratelimit.Decision, 8)
						errs := make([]error, len(ds))
						for i := range ds {
							wg.Go(func() { ds[i], errs[i] = l.Allow(ctx, fmt.Sprint("c", i)) })
						}
						wg.Wait()
						for i := range ds {
							misfit("concurrent Allow", ds[i], errs[i])
						}
					}
					for range threshold {
						md, err := ratelimit.AllowAll(ctx, ratelimit.AllOrNothing, ratelimit.Check{Limiter: l, Key: "k0"}, ratelimit.Check{Limiter: other, Key: "k0"})
						misfit("AllowAll", ratelimit.Decision{}, err)
						require.Empty(t, md.Decisions, "%s AllowAll: no failure policy answered", name)
					}
					tx, err := pool.Begin(ctx)
					require.NoError(t, err)
					d, err := l.AllowTx(ctx, tx, "k0")
					misfit("AllowTx", d, err)
					require.NoError(t, tx.Rollback(ctx))
					if m.peekFails {
						d, err := l.Peek(ctx, "k0")
						misfit("Peek", d, err)
					}
					require.False(t, l.BreakerOpen(), "%s: the breaker opened on a schema that does not fit", name)
					require.Zero(t, ratelimit.FallbackKeys(l), "%s: the memory tier counted", name)
					out := logs.String()
					require.Equal(t, 1, strings.Count(out, "level=ERROR"), "%s: logged once:\n%s", name, out)
					require.Contains(t, out, "limiter="+name)
					require.NotContains(t, out, "database unavailable", "%s: reported as an outage", name)
					limiters = append(limiters, checked{l, logs})
				}
			}

			_, err = pool.Exec(ctx, m.fix)
			require.NoError(t, err)
			for _, c := range limiters {
				name := c.l.Config().Name
				d, err := c.l.Allow(ctx, "k0")
				require.NoError(t, err, name)
				require.Equal(t, ratelimit.StorePostgres, d.Store, name)
				require.True(t, d.Allowed, name)
				require.Equal(t, int64(1), d.Used, "%s: counted, and nothing before", name)
				require.Equal(t, 1, strings.Count(c.logs.String(), "level=ERROR"), name)
			}
			d, err := other.Peek(ctx, "k0")
			require.NoError(t, err)
			require.Equal(t, int64(100), d.Remaining, "no AllowAll consumed the other limit")
		})
	}
}

// A setting the server refuses while connecting (options=-c with an unknown
// parameter: FATAL 42704) is a setup error too, and its message names the
// connection string as the thing to fix, not the migrations.
func TestRefusedConnectionSettingNamesTheConnectionString(t *testing.T) {
	t.Parallel()
	_, s := dbtest.Pool(t)
	url := dbtest.URLWithSchema(s) + "&options=-c%20pgrlnosuchsetting%3D1"
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	l := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "badsetting", Limit: 5, Window: time.Minute})
	d, err := l.Allow(context.Background(), "k")
	require.ErrorIs(t, err, ratelimit.ErrUnsupported, "%+v", d)
	require.ErrorContains(t, err, "fix the connection string")
	require.NotContains(t, err.Error(), "rl-migrate up")
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "FATAL", pgErr.Severity)
}
