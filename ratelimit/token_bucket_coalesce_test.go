package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/sqlops"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// tbRow is a bucket row as the statements leave it. The lease epoch is
// kept only while the row counts leased units: a row some statements make
// with their epoch and others without one counts no units either way.
type tbRow struct {
	TokensBits, UpdatedAtUs, FullAtUs int64
	Allowed                           bool
	EpochUs, Leased, LeasedPrev       int64
}

func readTBRow(t *testing.T, pool *pgxpool.Pool, key []byte) *tbRow {
	t.Helper()
	var r tbRow
	var epoch *int64
	err := pool.QueryRow(context.Background(), `
		SELECT pgrl_float8_bits(tokens), pgrl_us(updated_at), pgrl_us(full_at), allowed, lease_epoch_us,
		       coalesce(leased, 0), coalesce(leased_prev, 0)
		  FROM pgrl_token_bucket WHERE key = $1`, key,
	).Scan(&r.TokensBits, &r.UpdatedAtUs, &r.FullAtUs, &r.Allowed, &epoch, &r.Leased, &r.LeasedPrev)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	require.NoError(t, err)
	if epoch != nil && r.Leased+r.LeasedPrev > 0 {
		r.EpochUs = *epoch
	}
	return &r
}

// tbCheck is one check of a token bucket check statement: a slice when
// share > 0 (cost is its n), else cost, a partial grant with upTo.
type tbCheck struct {
	cost       int64
	upTo       bool
	min, share int64
}

// takeTBChecks decides checks of one key in one check statement (a run of
// the key's row) at instant at, with the property tests' figures.
func takeTBChecks(t *testing.T, pool *pgxpool.Pool, key string, at time.Time, penalty bool, checks ...tbCheck) []sqlops.TokenBucketTakeChecksRow {
	t.Helper()
	return tbStatement(t, pool, key, at, propCapacity, propRefill, penalty, checks...)
}

// sliceTB takes a slice of up to n units (min 1, share 1) of key's bucket
// at instant at, as a lease takes one: a check statement of one slice.
func sliceTB(t *testing.T, pool *pgxpool.Pool, key string, at time.Time, n int64, capacity, refill float64) sqlops.TokenBucketTakeChecksRow {
	t.Helper()
	return tbStatement(t, pool, key, at, capacity, refill, false, tbCheck{cost: n, upTo: true, min: 1, share: 1})[0]
}

func tbStatement(t *testing.T, pool *pgxpool.Pool, key string, at time.Time, capacity, refill float64, penalty bool, checks ...tbCheck) []sqlops.TokenBucketTakeChecksRow {
	t.Helper()
	n := len(checks)
	p := sqlops.TokenBucketTakeChecksParams{
		Keys: [][]byte{[]byte(key)}, Capacities: []float64{capacity}, RefillsPerUs: []float64{refill},
		Penalties: []bool{penalty}, Runs: []int32{1}, Ends: []int32{int32(n)}, At: &at,
	}
	for _, c := range checks {
		p.Rows = append(p.Rows, 1)
		p.Costs = append(p.Costs, c.cost)
		p.UpTo = append(p.UpTo, c.upTo)
		p.Vetoes = append(p.Vetoes, true)
		p.Mins = append(p.Mins, c.min)
		p.Shares = append(p.Shares, c.share)
	}
	rows, err := sqlops.New().TokenBucketTakeChecks(context.Background(), pool, p)
	require.NoError(t, err)
	require.Len(t, rows, n)
	return rows
}

// A key's slices and plain checks decided in one check statement leave
// the decisions and the row (balance, instants, lease counts) the same
// checks leave sent one per statement: a slice lowers the capacity the
// checks after it see at once, as it does for later statements, and its
// units are counted in the row. Under penalty (which only the SQL
// function takes with slices) the lowered capacity is the debt's floor.
func TestTokenBucketSlicesInOneStatementMatchOnePerStatement(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	at := base.Add(100 * time.Millisecond)
	slice := func(min, n, share int64) tbCheck { return tbCheck{cost: n, upTo: true, min: min, share: share} }
	for _, c := range []struct {
		name      string
		penalty   bool
		checks    []tbCheck
		granted   []int64
		allowed   []bool
		tokens    float64
		leased    int64
		laterUpTo int64 // what UpTo(10) grants 800 ms later: the refill stops at 10 - leased
	}{
		{name: "a slice, plain checks, a denied slice",
			checks:  []tbCheck{slice(1, 6, 1), {cost: 3}, {cost: 5, upTo: true}, slice(2, 4, 1), {cost: 1}},
			granted: []int64{6, 3, 1, 0, 0}, allowed: []bool{true, true, true, false, false},
			tokens: 0, leased: 6, laterUpTo: 4},
		{name: "plain checks, then slices sized by what they left",
			checks:  []tbCheck{{cost: 2}, slice(1, 8, 2), slice(1, 8, 2), {cost: 2, upTo: true}},
			granted: []int64{2, 4, 2, 2}, allowed: []bool{true, true, true, true},
			tokens: 0, leased: 6, laterUpTo: 4},
		{name: "penalty: the debt stops at the lowered capacity", penalty: true,
			checks:  []tbCheck{slice(1, 6, 1), slice(5, 8, 1), {cost: 20}},
			granted: []int64{6, 0, 0}, allowed: []bool{true, false, false},
			tokens: -4, leased: 6, laterUpTo: 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			one, many := c.name+"/one", c.name+"/many"
			got := takeTBChecks(t, pool, one, at, c.penalty, c.checks...)
			for i, chk := range c.checks {
				want := takeTBChecks(t, pool, many, at, c.penalty, chk)[0]
				want.CheckIndex = int32(i + 1)
				require.Equal(t, want, got[i], "check %d", i+1)
				require.Equal(t, c.granted[i], got[i].Granted, "check %d granted", i+1)
				require.Equal(t, c.allowed[i], got[i].Allowed, "check %d allowed", i+1)
			}
			row := readTBRow(t, pool, []byte(one))
			require.Equal(t, readTBRow(t, pool, []byte(many)), row)
			require.Equal(t, tbRow{TokensBits: bits(c.tokens), UpdatedAtUs: at.UnixMicro(), FullAtUs: row.FullAtUs,
				Allowed: row.Allowed, EpochUs: base.UnixMicro(), Leased: c.leased}, *row)
			require.Equal(t, base.UnixMicro()+2_000_000, row.FullAtUs, "full_at: after the leases")

			later := at.Add(800 * time.Millisecond)
			for _, key := range []string{one, many} {
				r := takeTBChecks(t, pool, key, later, false, tbCheck{cost: 10, upTo: true})[0]
				require.Equal(t, c.laterUpTo, r.Granted, "%s: the refill stops at the capacity less the leased units", key)
			}
			require.Equal(t, readTBRow(t, pool, []byte(many)), readTBRow(t, pool, []byte(one)))
		})
	}
}

func bits(f float64) int64 { return int64(math.Float64bits(f)) }

// TestTokenBucketCoalescedSlicesMatchSingleChecks is the exactness
// property of coalescing for a token bucket's slices: random batches of
// slices, checks and partial grants on three keys (so that keys repeat,
// and a slice is followed by plain checks of its key in the statement;
// slices often denied as the bucket drains; the clock stepping across
// lease epochs) decided as the coalescer decides one batch, in one check
// statement, give exactly the decisions of the same checks made one at a
// time, and leave the same rows: balance, instants and lease counts.
func TestTokenBucketCoalescedSlicesMatchSingleChecks(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	var mu sync.Mutex
	at := base.Add(17 * time.Second)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return at }
	cfg := ratelimit.Config{Algorithm: ratelimit.TokenBucket, Limit: 10, Burst: 12, Window: time.Second,
		DenyCacheSize: -1}
	bcfg, scfg := cfg, cfg
	bcfg.Name, scfg.Name = "tb-slices-batch", "tb-slices-single"
	batched := testkit.NewLimiter(t, pool, bcfg, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: clock})
	single := testkit.NewLimiter(t, pool, scfg,
		ratelimit.DatabaseOptions{Timeout: time.Minute, DisableCoalescing: true, Now: clock})
	rng := rand.New(rand.NewPCG(5, 6))
	var sliceThenPlain, granted, denied int
	for round := range 200 {
		mu.Lock()
		switch rng.IntN(4) {
		case 0: // stay: same instant
		case 1:
			at = at.Add(time.Duration(rng.Int64N(int64(700 * time.Millisecond))))
		case 2:
			at = at.Add(time.Duration(rng.Int64N(int64(3 * time.Second))))
		default: // across a lease epoch's edge, to within a microsecond of it
			at = at.Truncate(time.Second).Add(time.Second + time.Duration(rng.Int64N(3))*time.Microsecond)
		}
		mu.Unlock()
		n := 1 + rng.IntN(10)
		keys := make([]string, n)
		opts := make([]ratelimit.Option, n)
		sliced := map[string]bool{}
		for i := range n {
			keys[i] = fmt.Sprintf("k%d", rng.IntN(3))
			switch r := rng.IntN(20); {
			case r < 8:
				lo := 1 + rng.Int64N(2)
				opts[i] = ratelimit.Slice(lo, lo+rng.Int64N(7), 1+rng.Int64N(3))
				sliced[keys[i]] = true
				continue
			case r < 15:
				opts[i] = ratelimit.Cost(1 + rng.Int64N(4))
			default:
				opts[i] = ratelimit.UpTo(1 + rng.Int64N(6))
			}
			if sliced[keys[i]] {
				sliceThenPlain++
			}
		}
		got, err := ratelimit.TakeMixedOptions(ctx, repeat(batched, n), keys, opts)
		require.NoError(t, err, "round %d", round)
		for i := range n {
			want, err := single.Allow(ctx, keys[i], opts[i])
			require.NoError(t, err)
			require.Equal(t, want, got[i], "round %d check %d of %v %v", round, i, keys, opts)
			if opts[i].Value().Sliced {
				if got[i].Allowed {
					granted++
				} else {
					denied++
				}
			}
		}
		for k := range 3 {
			key := fmt.Sprintf("k%d", k)
			require.Equal(t,
				readTBRow(t, pool, ratelimit.StoredKey(scfg.KeyMode, scfg.Name, key)),
				readTBRow(t, pool, ratelimit.StoredKey(bcfg.KeyMode, bcfg.Name, key)),
				"round %d: row of %s", round, key)
		}
	}
	require.Greater(t, sliceThenPlain, 50, "plain checks after a slice of their key in the statement")
	require.Greater(t, granted, 50, "granted slices")
	require.Greater(t, denied, 20, "denied slices")
}
