package tests

// The recipes of docs/SQL.md, run as written: the PostgREST pre-request
// function and the Supabase wrapper, created from the documentation's own
// SQL (schema names moved to the test's), then called as PostgREST and
// Supabase would call them.

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// sqlDocBlock returns the ```sql block of section heading of docs/SQL.md
// that contains marker, with the documentation's schema names replaced.
func sqlDocBlock(t *testing.T, heading, marker string, names map[string]string) string {
	t.Helper()
	for _, b := range fencedBlocks(docSection(t, "../docs/SQL.md", heading), "sql") {
		if strings.Contains(b, marker) {
			for from, to := range names {
				b = strings.ReplaceAll(b, from, to)
			}
			return b
		}
	}
	t.Fatalf("docs/SQL.md %q has no sql block with %q", heading, marker)
	return ""
}

// The PostgREST recipe: the pre-request function admits a client's first
// requests and then raises what PostgREST turns into a 429 with
// Retry-After; clients are told apart by their JWT's subject, else by the
// first address of X-Forwarded-For.
func TestSQLDocPostgRESTRecipe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	api := dbtest.NewSchema(t)
	q := pgx.Identifier{s}.Sanitize() + "."
	fn := sqlDocBlock(t, "## PostgREST: every request, before it runs", "limit_requests",
		map[string]string{"api.": pgx.Identifier{api}.Sanitize() + ".", "ratelimit.": q})
	_, err := pool.Exec(ctx, fn)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('postgrest', 3, '1 day')`)
	require.NoError(t, err)

	request := func(headers, claims string) error {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, "SELECT set_config('request.headers', $1, true), set_config('request.jwt.claims', $2, true)",
			headers, claims)
		require.NoError(t, err)
		if _, err = tx.Exec(ctx, "SELECT "+pgx.Identifier{api}.Sanitize()+".limit_requests()"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	for i := range 3 {
		require.NoError(t, request(`{"x-forwarded-for": "203.0.113.7, 10.0.0.1"}`, ""), "request %d", i)
	}
	err = request(`{"x-forwarded-for": "203.0.113.7"}`, "")
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%v", err)
	require.Equal(t, "PGRST", pgErr.Code)
	var msg struct {
		Code, Message string
	}
	require.NoError(t, json.Unmarshal([]byte(pgErr.Message), &msg), pgErr.Message)
	require.Equal(t, "rate_limited", msg.Code)
	var detail struct {
		Status  int
		Headers map[string]string
	}
	require.NoError(t, json.Unmarshal([]byte(pgErr.Detail), &detail), pgErr.Detail)
	require.Equal(t, 429, detail.Status)
	require.NotEmpty(t, detail.Headers["Retry-After"])

	// Another address, and a signed-in user, have their own counts.
	require.NoError(t, request(`{"x-forwarded-for": "198.51.100.1"}`, ""))
	for range 3 {
		require.NoError(t, request(`{"x-forwarded-for": "203.0.113.7"}`, `{"sub": "user-1"}`))
	}
	require.Error(t, request(`{}`, `{"sub": "user-1"}`))
}

// The Supabase recipe: the wrapper counts under the signed-in user's id
// (auth.uid(), stood in for by a function of the test's), whoever calls it.
func TestSQLDocSupabaseRecipe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, s := dbtest.Pool(t)
	auth, pub := dbtest.NewSchema(t), dbtest.NewSchema(t)
	a, p := pgx.Identifier{auth}.Sanitize(), pgx.Identifier{pub}.Sanitize()
	_, err := pool.Exec(ctx, "CREATE FUNCTION "+a+".uid() RETURNS uuid LANGUAGE sql STABLE AS "+
		"$$ SELECT nullif(current_setting('request.jwt.claim.sub', true), '')::uuid $$")
	require.NoError(t, err)
	fn := sqlDocBlock(t, "## Supabase: an RPC a client calls", "check_send_limit", map[string]string{
		"auth.": a + ".", "public.": p + ".", "ratelimit.": pgx.Identifier{s}.Sanitize() + ".",
		"TO authenticated": "TO PUBLIC", "FROM public": "FROM PUBLIC",
	})
	_, err = pool.Exec(ctx, fn)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy (name, "limit", "window") VALUES ('messages', 2, '1 day')`)
	require.NoError(t, err)
	call := func(user string) (allowed bool) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, "SELECT set_config('request.jwt.claim.sub', $1, true)", user)
		require.NoError(t, err)
		var retry int64
		require.NoError(t, tx.QueryRow(ctx, "SELECT * FROM "+p+".check_send_limit()").Scan(&allowed, &retry))
		require.NoError(t, tx.Commit(ctx))
		return allowed
	}
	const alice, bob = "0b6f1b5e-5f53-4c4a-9d43-7a1d2b3c4d5e", "9a8b7c6d-1e2f-4a3b-8c9d-0e1f2a3b4c5d"
	require.True(t, call(alice))
	require.True(t, call(alice))
	require.False(t, call(alice), "the user's limit")
	require.True(t, call(bob), "another user counts apart")
}
