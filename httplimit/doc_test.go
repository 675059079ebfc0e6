package httplimit_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// TestHTTPDocResponse holds the 429 shown under "Responses" in docs/HTTP.md
// to what the middleware of the documented snippet (Limit 2 a minute, at the
// example's pinned clock) really answers: status, headers and body.
func TestHTTPDocResponse(t *testing.T) {
	doc, err := os.ReadFile("../docs/HTTP.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(doc), "### Responses")
	require.True(t, ok, "docs/HTTP.md has a Responses section")
	_, block, ok := strings.Cut(after, "```\n")
	require.True(t, ok)
	block, _, ok = strings.Cut(block, "```")
	require.True(t, ok)

	// A long Timeout: the test needs PostgreSQL's answer, also on a loaded
	// machine (the documented response does not depend on it).
	lim, err := testkit.New(pool, ratelimit.Config{Name: "public-api", Limit: 2, Window: time.Minute}, ratelimit.DatabaseOptions{Timeout: time.Minute, Now: exampleClock})
	require.NoError(t, err)
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("doc-response")})
	require.NoError(t, err)
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") }))
	var rec *httptest.ResponseRecorder
	for range 3 {
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/api/v1/items", nil))
	}
	require.Equal(t, http.StatusTooManyRequests, rec.Code)

	var got strings.Builder
	fmt.Fprintf(&got, "HTTP/1.1 %d %s\n", rec.Code, http.StatusText(rec.Code))
	for _, name := range []string{"Content-Type", "Content-Length", "Retry-After", "RateLimit-Policy", "RateLimit"} {
		v := rec.Header().Get(name)
		if name == "Content-Length" && v == "" {
			v = fmt.Sprint(rec.Body.Len())
		}
		fmt.Fprintf(&got, "%s: %s\n", name, v)
	}
	fmt.Fprintf(&got, "\n%s", rec.Body.String())
	require.Equal(t, got.String(), block, "docs/HTTP.md's 429 is what the middleware answers")
}
