// Command rl-policy manages the rate limits stored in the database (package
// policy): policies, per-key overrides, and why a key is limited. Run
// `rl-policy --help`.
package main

import "github.com/pgrl/pgrl/internal/cli"

func main() { cli.Main(run) }
