package ulule_test

import (
	"testing"
	"time"

	"github.com/ulule/limiter/v3/drivers/store/tests"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ulule"
)

// newStore returns a store on a fresh, migrated schema of its own.
func newStore(t *testing.T, opts ulule.Options) *ulule.Store {
	t.Helper()
	pool, _ := dbtest.Pool(t, dbtest.WithMaxConns(16))
	s, err := ulule.NewStoreWithOptions(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// withTimeout runs f and fails the test when it has not returned within d.
// ulule's concurrency test calls require inside goroutines that do not
// defer wg.Done, so a store error there would hang it forever instead of
// failing it.
func withTimeout(t *testing.T, d time.Duration, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("did not finish within %v (a store error inside ulule's goroutines hangs its test)", d)
	}
}

// ulule's own store suite, unmodified, against pgrl.

func TestULuleSuiteSequentialAccess(t *testing.T) {
	t.Parallel()
	s := newStore(t, ulule.Options{})
	withTimeout(t, time.Minute, func() { tests.TestStoreSequentialAccess(t, s) })
}

func TestULuleSuiteConcurrentAccess(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("250,000 checks; run without -short")
	}
	// The suite counts exactly under heavy concurrency and fails on any
	// error: a long Timeout, for a busy test machine, on which a call that
	// waits for one of the pool's few connections behind thousands of
	// others could pass the default.
	s := newStore(t, ulule.Options{Timeout: time.Minute})
	withTimeout(t, 5*time.Minute, func() { tests.TestStoreConcurrentAccess(t, s) })
}

func BenchmarkULuleSuiteSequentialAccess(b *testing.B) {
	pool, _ := dbtest.Pool(b)
	s, err := ulule.NewStore(pool)
	if err != nil {
		b.Fatal(err)
	}
	tests.BenchmarkStoreSequentialAccess(b, s)
}

func BenchmarkULuleSuiteConcurrentAccess(b *testing.B) {
	pool, _ := dbtest.Pool(b, dbtest.WithMaxConns(16))
	s, err := ulule.NewStore(pool)
	if err != nil {
		b.Fatal(err)
	}
	tests.BenchmarkStoreConcurrentAccess(b, s)
}
