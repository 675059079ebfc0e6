// Command rl-bench is pgbench for pgrl's limiters: it measures, on your own
// database, what one rate-limit check costs, and how close the ratelimit
// library comes to the bare SQL statement it sends.
//
// For each algorithm (--algorithms), each number of concurrent callers
// (--callers, default 1,8) and each key spread (--keys, default 100000,1) it
// runs two paths against the same counter rows:
//
//   - raw: the generated statement (package gen) sent through pgx directly,
//     with the key already hashed: the floor for one check;
//   - library: ratelimit.Limiter.Allow, which sends a check that goes out
//     alone as byte for byte the same statement with the same parameters,
//     and builds a Decision.
//
// The two paths alternate in slices of about 100 ms within each case, so
// that noise from other work on the machine falls on both alike. Each gets
// --duration in total. The report gives ops/s, p50 and p99 latency of both, their ratios,
// and afterwards the share of HOT updates of each counter table from
// pg_stat_user_tables.
//
// The library runs with its default configuration, so that the figures are
// what an application gets. By default a Limiter coalesces checks that
// arrive while DatabaseOptions.MaxInFlight round trips are running into one
// multi-key statement; the raw path sends every check alone. --coalescing=false
// and --max-in-flight change the library's configuration to show what the
// coalescing costs or saves on your workload.
//
// Limits are set so high (1e9 an hour) that every check is admitted, and
// every key is touched once before the measurement, so the measured checks
// take the update path of the upsert, which is what a busy limiter does.
//
// --concurrency measures a concurrency limit instead: Limiter.Acquire of a
// slot (Limit 1,000,000, so never refused; Window 30s) then its
// Slot.Release, against Limiter.Allow of the fixed window, on one Database
// with the library's defaults, interleaved the same way, for each number of
// callers and key spread. It reports the acquire's p50 alone and with its
// release, each as a ratio to the check's. Then it holds --hold-slots slots
// at once (default 1, 100 and 1000, spread over at most --hold-keys keys,
// each number by a Database of its own) for --hold-for (65s) with a
// --hold-window (30s) lease, and counts the statements that extend them:
// as they go through each Database's DB, in the rows of pgrl_concurrency
// written meanwhile, and in pg_stat_statements when the server has it
// loaded. It reports them per minute and per slot held per minute, beside
// the keeper's schedule (3 per Window, for all the slots of a Database).
//
//	rl-bench --database-url postgres://user@host/db --duration 5s
//	rl-bench --algorithms token_bucket --callers 1,8,32 --keys 1 --output json
//
// The tables live in --schema (default pgrl_bench), which rl-bench creates
// and migrates; rows it writes stay there. Drop the schema when done:
// DROP SCHEMA pgrl_bench CASCADE.
//
// Exit status: 0 when the benchmark ran, 1 on a runtime error, 2 on bad
// flags.
package main

import "github.com/pgrl/pgrl/internal/cli"

func main() { cli.Main(run) }
