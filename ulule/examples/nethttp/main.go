// Command nethttp is the service of docs/ULULE.md: a net/http server limited
// by ulule/limiter's middleware, 10 requests a minute per client IP, with its
// counters in Redis or (with --store pgrl) in PostgreSQL through pgrl.
//
//	go run ./examples/nethttp --store pgrl --database-url postgres://...
//	curl -i localhost:8080/
package main

import (
	"context"
	"flag"
	"log"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	libredis "github.com/redis/go-redis/v9"
	"github.com/ulule/limiter/v3"
	"github.com/ulule/limiter/v3/drivers/middleware/stdlib"
	sredis "github.com/ulule/limiter/v3/drivers/store/redis"

	"github.com/pgrl/pgrl/ulule"
)

func main() {
	which := flag.String("store", "redis", "redis or pgrl")
	redisAddr := flag.String("redis-addr", "127.0.0.1:6379", "Redis host:port")
	dbURL := flag.String("database-url", "postgres://postgres@127.0.0.1:5432/pgrl_test?sslmode=disable", "PostgreSQL URL (run rl-migrate up against it first)")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()

	var store limiter.Store
	var err error
	switch *which {
	case "redis":
		store, err = sredis.NewStore(libredis.NewClient(&libredis.Options{Addr: *redisAddr}))
	case "pgrl":
		var pool *pgxpool.Pool
		pool, err = pgxpool.New(context.Background(), *dbURL)
		if err == nil {
			store, err = ulule.NewStore(pool) // the one line that changes
		}
	default:
		log.Fatalf("--store %q: use redis or pgrl", *which)
	}
	if err != nil {
		log.Fatal(err)
	}

	rate := limiter.Rate{Period: time.Minute, Limit: 10}
	mw := stdlib.NewMiddleware(limiter.New(store, rate))
	hello := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("hello\n"))
	})
	log.Printf("listening on %s, counters in %s", *addr, *which)
	log.Fatal(http.ListenAndServe(*addr, mw.Handler(hello)))
}
