// Command vsredis compares pgrl's limiter, with its counters in PostgreSQL,
// against github.com/go-redis/redis_rate, with its counters in Redis, on the
// same machine, in one run, with the same callers and the same keys.
//
// For each number of concurrent callers (--callers, default 1,8,32,64) and
// each key space (--keys, default 100000,1) it measures, in alternating
// slices so that noise from other work on the machine falls on all alike:
//
//   - pgrl: ratelimit.Limiter.Allow with the token bucket (the closest to
//     redis_rate's GCRA) and coalescing as configured (on by default);
//   - redis_rate: redis_rate.Limiter.Allow with an equivalent limit;
//   - with --compare-coalescing, also pgrl with DisableCoalescing set, on
//     the same pool and rows.
//
// Every call draws a random key from the key space. Both limits refill one
// unit a second with a burst of 1e9, so every check is admitted and every
// key's state (a PostgreSQL row, a Redis key with a TTL that only grows)
// persists: after every key is touched once before the first case, both
// stores take their update path, as a busy limiter does.
//
// The report gives, per case and path, ops/s, p50 and p99 latency, the
// client's CPU time per check and the machine's CPU use while the path ran,
// and for pgrl the number of statements sent and the average batch size.
//
//	vsredis --duration 5s --output json > vsredis.json
//	vsredis --callers 64 --keys 100000 --max-in-flight 1 --cpuprofile cpu.out
//
// The counter tables live in --schema (default pgrl_redisbench), created and
// migrated; the Redis keys are "rate:key-N" in --redis-db. Drop the schema
// when done: DROP SCHEMA pgrl_redisbench CASCADE.
//
// Exit status: 0 when the benchmark ran, 1 on a runtime error, 2 on bad
// flags.
package main

import "github.com/pgrl/pgrl/internal/cli"

func main() { cli.Main(run) }
