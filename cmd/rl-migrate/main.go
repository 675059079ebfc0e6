// Command rl-migrate applies pgrl's schema migrations to a PostgreSQL
// database, for deploy pipelines and by hand. Run `rl-migrate --help`.
package main

import "github.com/pgrl/pgrl/internal/cli"

func main() { cli.Main(run) }
