// Package ginlimit puts an httplimit.Middleware in front of gin handlers.
package ginlimit

import (
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/pgrl/pgrl/httplimit"
)

// Middleware returns m as gin middleware: a request the limit admits goes
// on down gin's chain (with the rate-limit fields m writes already on the
// response); one it refuses is answered by m, and the chain stops there.
func Middleware(m *httplimit.Middleware) gin.HandlerFunc {
	return func(c *gin.Context) {
		passed := false
		m.Handler(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
			passed = true
			c.Request = r
			c.Next()
		})).ServeHTTP(c.Writer, c.Request)
		if !passed {
			c.Abort()
		}
	}
}
