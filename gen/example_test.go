package gen_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/dbtest"
)

// examplePool is a pool on a migrated schema of the test database, made by
// TestMain for the examples (an Example cannot take a *testing.T).
var examplePool *pgxpool.Pool

func TestMain(m *testing.M) {
	os.Exit(runWithExampleSchema(m))
}

func runWithExampleSchema(m *testing.M) int {
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, dbtest.URL())
	if err != nil {
		fmt.Fprintf(os.Stderr, "test database %s unreachable (%v); run scripts/test.sh\n", dbtest.URL(), err)
		return 1
	}
	defer admin.Close(ctx)
	schemaName := fmt.Sprintf("pgrl_example_%d", os.Getpid())
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schemaName); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer admin.Exec(ctx, "DROP SCHEMA "+schemaName+" CASCADE") //nolint:errcheck
	if err := dbtest.Apply(ctx, admin, schemaName); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	examplePool, err = pgxpool.New(ctx, dbtest.URLWithSchema(schemaName))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer examplePool.Close()
	return m.Run()
}

// Five logins a minute per account: take a unit for each attempt, straight
// from a pool. At pins the clock so that the output is the same on every
// run; production leaves it nil and the database's clock decides.
func Example() {
	ctx := context.Background()
	pool := examplePool // your *pgxpool.Pool, on the schema rl-migrate migrated
	q := gen.New()
	at := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	for i := range 6 {
		row, err := q.FixedWindowTake(ctx, pool, gen.FixedWindowTakeParams{
			Key:      []byte("login:alice@example.com"),
			Cost:     1,
			MaxCount: 5,
			WindowUs: time.Minute.Microseconds(),
			At:       &at,
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("attempt %d: allowed=%v count=%d window ends %s\n",
			i+1, row.Allowed, row.Count, time.UnixMicro(row.ExpiresAtUs).UTC().Format(time.TimeOnly))
	}
	// Output:
	// attempt 1: allowed=true count=1 window ends 03:05:00
	// attempt 2: allowed=true count=2 window ends 03:05:00
	// attempt 3: allowed=true count=3 window ends 03:05:00
	// attempt 4: allowed=true count=4 window ends 03:05:00
	// attempt 5: allowed=true count=5 window ends 03:05:00
	// attempt 6: allowed=false count=5 window ends 03:05:00
}

// A check inside the caller's own transaction: the spend commits or rolls
// back with the work it guards. Here the work fails, so the token comes back.
func ExampleQueries_TokenBucketTake_transaction() {
	ctx := context.Background()
	q := gen.New()
	at := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	params := gen.TokenBucketTakeParams{
		Key:         []byte("upload:42"),
		Cost:        1,
		Capacity:    10,
		RefillPerUs: 10.0 / float64(time.Minute.Microseconds()), // 10 a minute
		At:          &at,
	}
	err := pgx.BeginFunc(ctx, examplePool, func(tx pgx.Tx) error {
		row, err := q.TokenBucketTake(ctx, tx, params)
		if err != nil {
			return err
		}
		fmt.Printf("in the transaction: allowed=%v tokens=%d\n", row.Allowed, int(tokens(row.TokensBits)))
		return fmt.Errorf("the upload failed")
	})
	fmt.Println("transaction:", err)

	peek, err := q.TokenBucketPeek(ctx, examplePool, gen.TokenBucketPeekParams{
		Key: params.Key, Capacity: params.Capacity, RefillPerUs: params.RefillPerUs, At: &at,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("after the rollback: tokens=%d\n", int(tokens(peek.TokensBits)))
	// Output:
	// in the transaction: allowed=true tokens=9
	// transaction: the upload failed
	// after the rollback: tokens=10
}

// A partial grant hands out what is left of a quota: as many of N units
// as the window still holds, possibly none.
func ExampleQueries_FixedWindowTakeUpTo() {
	ctx := context.Background()
	q := gen.New()
	at := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, n := range []int64{3, 4, 2} {
		r, err := q.FixedWindowTakeUpTo(ctx, examplePool, gen.FixedWindowTakeUpToParams{
			Key:      []byte("export:tenant-7"),
			N:        n, // a ceiling: any n >= 1
			MaxCount: 5,
			WindowUs: time.Hour.Microseconds(),
			At:       &at,
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("asked %d: granted=%d count=%d allowed=%v\n", n, r.Granted, r.Count, r.Allowed)
	}
	// Output:
	// asked 3: granted=3 count=3 allowed=true
	// asked 4: granted=2 count=5 allowed=true
	// asked 2: granted=0 count=5 allowed=false
}

// tokens is the token balance a TokensBits column carries.
func tokens(bits int64) float64 { return math.Float64frombits(uint64(bits)) }
