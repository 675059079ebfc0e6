// Command vsredis compares pgrl's limiter, with its counters in PostgreSQL,
// against github.com/go-redis/redis_rate, with its counters in Redis, on the
// same machine, in one run, with the same callers and the same keys.
//
// For each number of concurrent callers (--callers, default 1,8,32,64) and
// each key space (--keys, default 100000,10,1: many keys, a few hot keys,
// one hot key) it measures, in alternating slices so that noise from other
// work on the machine falls on all alike:
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
// With --mix app (the default; --mix none leaves it out), each number of
// callers also runs the application mix: the nine limits of the example
// application's policy table (examples/app/limits.go), nine pgrl limiters
// on one pool (the beacon's in memory, as the application keeps it) against
// nine redis_rate limits (the beacon's in Redis), with the users' emails
// and addresses drawn with a Zipf skew, and endpoints drawn with fixed
// weights; a login checks three limits, in one ratelimit.AllowAll on pgrl's
// side and with three Allow calls on redis_rate's. It reports requests/s
// and checks/s of both sides, and pgrl's checks per statement and
// statements per round trip.
//
// With --lease-size N (off by default), pgrl's limiter in the key-space
// cases and the mix's limits checked alone are wrapped with package lease
// (Options.Size N, at most each limit; --lease-share, --lease-idle);
// the report names the leased limits, sums their lease.Stats per case, and
// checks that none admitted over its limit.
//
// The report gives, per case and path, ops/s, p50 and p99 latency, the
// client's CPU time per check and the machine's CPU use while the path ran,
// and for pgrl the number of statements sent and the average batch size.
//
//	vsredis --duration 5s --output json > vsredis.json
//	vsredis --callers 64 --keys 100000 --max-in-flight 1 --cpuprofile cpu.out
//	vsredis --callers 8,32,64 --keys 10 --mix app --duration 2s
//
// The counter tables live in --schema (default pgrl_redisbench), created and
// migrated; the Redis keys are "rate:key-N", and "rate:LIMIT:KEY" for the
// mix, in --redis-db. Drop the schema when done: DROP SCHEMA
// pgrl_redisbench CASCADE.
//
// Exit status: 0 when the benchmark ran, 1 on a runtime error, 2 on bad
// flags.
package main

import "github.com/pgrl/pgrl/internal/cli"

func main() { cli.Main(run) }
