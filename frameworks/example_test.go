package frameworks_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"

	"github.com/pgrl/pgrl/frameworks/ginlimit"
	"github.com/pgrl/pgrl/httplimit"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/ratelimit"
)

// pool stands for the application's *pgxpool.Pool: a fresh schema of the
// test database, with pgrl's migrations applied.
var pool *pgxpool.Pool

// exampleClock pins the examples' clock, so that their output does not
// depend on when they run. Applications leave Now unset.
func exampleClock() time.Time { return time.Date(2030, 1, 2, 3, 4, 30, 0, time.UTC) }

// exampleTimeout bounds the examples' checks (DatabaseOptions.Timeout).
// Their output is what PostgreSQL decided; on a busy test machine a first
// statement can outlast DefaultTimeout and be answered by the failure
// policy instead. Applications keep the default, or set their own.
const exampleTimeout = 10 * time.Second

func TestMain(m *testing.M) {
	p, _, done, err := dbtest.ForExamples()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pool = p
	gin.SetMode(gin.ReleaseMode)
	code := m.Run()
	done()
	os.Exit(code)
}

// middleware is an httplimit.Middleware of 2 requests a minute per API key
// (the X-API-Key header), on a limiter named name.
func middleware(name string) *httplimit.Middleware {
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Now: exampleClock, Timeout: exampleTimeout})
	if err != nil {
		log.Fatal(err)
	}
	lim, err := limits.Limiter(ratelimit.Config{Name: name, Limit: 2, Window: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httplimit.New(httplimit.Config{Limiter: lim, Key: httplimit.ByHeader("X-API-Key")})
	if err != nil {
		log.Fatal(err)
	}
	return mw
}

// send makes three requests with one API key and prints what came back.
func send(h http.Handler) {
	for range 3 {
		req := httptest.NewRequest("GET", "/items", nil)
		req.Header.Set("X-API-Key", "key-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %q RateLimit: %s\n", rec.Code, rec.Body.String(), rec.Header().Get("RateLimit"))
	}
}

func Example_gin() {
	r := gin.New()
	r.Use(ginlimit.Middleware(middleware("gin-api")))
	r.GET("/items", func(c *gin.Context) { c.String(http.StatusOK, "items") })
	send(r)
	// Output:
	// 200 "items" RateLimit: "gin-api";r=1;t=30
	// 200 "items" RateLimit: "gin-api";r=0;t=30
	// 429 "{\"error\":\"rate_limited\",\"retry_after\":30}\n" RateLimit: "gin-api";r=0;t=30
}

func Example_echo() {
	e := echo.New()
	e.Use(echo.WrapMiddleware(middleware("echo-api").Handler))
	e.GET("/items", func(c echo.Context) error { return c.String(http.StatusOK, "items") })
	send(e)
	// Output:
	// 200 "items" RateLimit: "echo-api";r=1;t=30
	// 200 "items" RateLimit: "echo-api";r=0;t=30
	// 429 "{\"error\":\"rate_limited\",\"retry_after\":30}\n" RateLimit: "echo-api";r=0;t=30
}
