package ginlimit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/frameworks/ginlimit"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/internal/testkit"
	"github.com/pgrl/pgrl/ratelimit"
)

// A refused request stops gin's chain: neither the middleware after the
// limit nor the handler runs, and what runs after the chain sees it
// aborted. An admitted one runs both, with the request as the limit saw it.
func TestMiddlewareStopsTheChain(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	pool, _ := dbtest.Pool(t)
	lim := testkit.NewLimiter(t, pool, ratelimit.Config{Name: "gin", Limit: 2, Window: time.Hour})
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.Constant("all")})
	require.NoError(t, err)
	after, handled, aborted := 0, 0, 0
	r := gin.New()
	r.Use(func(c *gin.Context) {
		c.Next()
		if c.IsAborted() {
			aborted++
		}
	})
	r.Use(ginlimit.Middleware(mw))
	r.Use(func(c *gin.Context) { after++ })
	r.GET("/", func(c *gin.Context) {
		handled++
		require.Equal(t, "v", c.Request.Context().Value(ctxKey{}))
		c.Status(http.StatusNoContent)
	})
	codes := []int{}
	for range 4 {
		req := httptest.NewRequest("GET", "/", nil)
		req = req.WithContext(context.WithValue(req.Context(), ctxKey{}, "v"))
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, req)
		codes = append(codes, rec.Code)
	}
	require.Equal(t, []int{204, 204, 429, 429}, codes)
	require.Equal(t, 2, after)
	require.Equal(t, 2, handled)
	require.Equal(t, 2, aborted)
}

type ctxKey struct{}
