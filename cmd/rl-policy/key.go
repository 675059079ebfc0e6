package main

// rl-policy key get|reset: one key's counter under any limiter, the
// `redis-cli GET` / `DEL` of pgrl. A stored policy gives its shape itself;
// a limiter defined in code is described by flags named as in
// ratelimit.Config.

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/gen"
	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// shapeFlags describe a limiter defined in code, with the names and
// defaults of ratelimit.Config. They are read as text so that a bad value
// gets a message naming the flag and an example.
type shapeFlags struct {
	algorithm, limit, window, burst, keyMode, spread string
	keyByWindow                                      bool
}

// shapeFlagNames lists the shape flags, as the messages name them.
var shapeFlagNames = []string{"algorithm", "limit", "window", "burst", "key-mode", "key-by-window", "spread"}

func (f *shapeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.algorithm, "algorithm", "", "")
	fs.StringVar(&f.limit, "limit", "", "")
	fs.StringVar(&f.window, "window", "", "")
	fs.StringVar(&f.burst, "burst", "", "")
	fs.StringVar(&f.keyMode, "key-mode", "", "")
	fs.StringVar(&f.spread, "spread", "", "")
	fs.BoolVar(&f.keyByWindow, "key-by-window", false, "")
}

// config reads the shape flags given into a configuration for name. It
// checks each value on its own; Database.Limiter checks them together.
func (f *shapeFlags) config(name string, set map[string]bool) (ratelimit.Config, error) {
	cfg := ratelimit.Config{Name: name, Algorithm: ratelimit.DefaultAlgorithm, KeyByWindow: f.keyByWindow}
	var err error
	if set["algorithm"] {
		if cfg.Algorithm, err = ratelimit.ParseAlgorithm(f.algorithm); err != nil {
			return cfg, usagef("--algorithm %q: use fixed_window, token_bucket or sliding_window (Config.Algorithm)", f.algorithm)
		}
	}
	if set["limit"] {
		if cfg.Limit, err = strconv.ParseInt(f.limit, 10, 64); err != nil || cfg.Limit < 1 {
			return cfg, usagef("--limit %q: give the limiter's Config.Limit, a whole number from 1 to %d", f.limit, int64(math.MaxInt64))
		}
	}
	if set["window"] {
		if cfg.Window, err = time.ParseDuration(f.window); err != nil {
			return cfg, usagef("--window %q is not a duration: write it as Go does, such as 500ms, 90s, 15m or 24h", f.window)
		}
		if cfg.Window <= 0 {
			return cfg, usagef("--window %s: the window must be positive, such as 1m (Config.Window)", f.window)
		}
	}
	if set["burst"] {
		if cfg.Burst, err = strconv.ParseInt(f.burst, 10, 64); err != nil || cfg.Burst < 0 {
			return cfg, usagef("--burst %q: give the token bucket's Config.Burst, a whole number from 1 to 2^53, or 0 for the default (the limit)", f.burst)
		}
	}
	if set["key-mode"] {
		if cfg.KeyMode, err = policy.ParseKeyMode(f.keyMode); err != nil || f.keyMode == "" {
			return cfg, usagef("--key-mode %q: use hashed (the default) or readable (Config.KeyMode)", f.keyMode)
		}
	}
	if set["spread"] {
		n, err := strconv.ParseInt(f.spread, 10, 32)
		if err != nil || n < 0 {
			return cfg, usagef("--spread %q: give the limiter's Config.Spread, a whole number of rows (1, the default, or more)", f.spread)
		}
		cfg.Spread = int(n)
	}
	return cfg, nil
}

// keyTarget is the limiter a key command works on.
type keyTarget struct {
	cfg      ratelimit.Config // defaults not filled in
	source   string           // "policy" or "flags"
	policy   *policy.Policy   // the stored policy, when source is "policy"
	override *policy.Override // the key's override in force, if any
	ignored  string           // why an override in force is not applied
}

// key runs `rl-policy key get|reset`.
func (a *app) key(ctx context.Context, rest []string) error {
	if len(rest) == 0 {
		return usagef("key needs a subcommand: get or reset, e.g. `rl-policy key get login ada@example.com`")
	}
	cmd := rest[0]
	if cmd != "get" && cmd != "reset" {
		return usagef("unknown key subcommand %q: use get or reset", cmd)
	}
	sub := newFlagSet("rl-policy key " + cmd)
	a.g.register(sub)
	var f shapeFlags
	f.register(sub)
	keyHex := sub.String("key-hex", "", "")
	pos, err := a.parse(sub, rest[1:])
	if err != nil {
		return err
	}
	set := given(sub)
	var name, key string
	switch {
	case set["key-hex"] && len(pos) == 1:
		b, err := hex.DecodeString(strings.TrimPrefix(*keyHex, `\x`))
		if err != nil {
			return usagef("--key-hex %q is not hexadecimal bytes, such as 00ff41 for the bytes 0x00 0xff 'A'", *keyHex)
		}
		name, key = pos[0], string(b)
	case set["key-hex"]:
		return usagef("key %s takes the limiter's name and --key-hex, without a KEY argument", cmd)
	case len(pos) == 2:
		name, key = pos[0], pos[1]
		if key == "" {
			return usagef("KEY is empty, which is most often an unset shell variable; to reach the empty key itself, give --key-hex ''")
		}
	default:
		return usagef("key %s takes two arguments, the limiter's name and the key (or --key-hex HEX instead of the key), e.g. `rl-policy key %s login ada@example.com`", cmd, cmd)
	}
	if name == "" {
		return usagef("NAME is empty: give the limiter's Config.Name, or a stored policy's name")
	}
	var shapeGiven []string
	for _, n := range shapeFlagNames {
		if set[n] {
			shapeGiven = append(shapeGiven, "--"+n)
		}
	}
	flagCfg, err := f.config(name, set)
	if err != nil {
		return err
	}
	conn, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer closeConn(conn)
	if cmd == "get" {
		// One snapshot: the counter and its rows are read at one instant.
		return pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
			t, err := resolveKey(ctx, tx, name, key, flagCfg, shapeGiven)
			if err != nil {
				return err
			}
			return a.keyGet(ctx, tx, t, key)
		})
	}
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		t, err := resolveKey(ctx, tx, name, key, flagCfg, shapeGiven)
		if err != nil {
			return err
		}
		return a.keyReset(ctx, tx, t, key)
	})
}

// resolveKey finds the limiter named name: the stored policy of that name,
// at the rate that applies to key, or else the one the flags describe.
func resolveKey(ctx context.Context, tx pgx.Tx, name, key string, flagCfg ratelimit.Config, shapeGiven []string) (keyTarget, error) {
	// A name that does not match cannot be a stored policy, so it is not
	// looked up (a NUL byte would not even reach the table).
	if ratelimit.ValidPolicyName(name) {
		p, err := lookupPolicy(ctx, tx, name)
		switch {
		case err == nil:
			if len(shapeGiven) > 0 {
				return keyTarget{}, usagef("%q is a stored policy, whose shape comes from pgrl_policy: drop %s (see it with `rl-policy get %s`)",
					name, strings.Join(shapeGiven, ", "), name)
			}
			if err := checkKeyLen(p.KeyMode, key); err != nil {
				return keyTarget{}, err
			}
			x, err := policy.Explain(ctx, tx, name, key)
			if err != nil {
				return keyTarget{}, err
			}
			cfg := x.Policy.Config(ratelimit.Config{})
			cfg.Limit, cfg.Window, cfg.Burst = x.Rate.Limit, x.Rate.Window, x.Rate.Burst
			return keyTarget{cfg: cfg, source: "policy", policy: &x.Policy, override: x.Override, ignored: x.Ignored}, nil
		case errors.Is(err, policy.ErrNotFound), errors.Is(err, policy.ErrNotMigrated):
			// Not a stored policy (or no policy tables): a limiter in code.
		default:
			return keyTarget{}, err
		}
	}
	var missing []string
	if flagCfg.Limit == 0 {
		missing = append(missing, "--limit N")
	}
	if flagCfg.Window == 0 {
		missing = append(missing, "--window D")
	}
	if len(missing) > 0 {
		return keyTarget{}, usagef("%q is not a stored policy; for a limiter defined in code give its shape as in its ratelimit.Config: %s, and --algorithm, --burst, --key-mode, --key-by-window or --spread where the Config sets them",
			name, strings.Join(missing, " "))
	}
	if err := checkKeyLen(flagCfg.KeyMode, key); err != nil {
		return keyTarget{}, err
	}
	return keyTarget{cfg: flagCfg, source: "flags"}, nil
}

// lookupPolicy is policy.Get in a savepoint, so that missing policy tables
// (an installation before migration 7) leave the transaction usable.
func lookupPolicy(ctx context.Context, tx pgx.Tx, name string) (policy.Policy, error) {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return policy.Policy{}, err
	}
	p, err := policy.Get(ctx, sp, name)
	if rerr := sp.Rollback(ctx); err == nil && rerr != nil {
		err = rerr
	}
	return p, err
}

// checkKeyLen refuses a key that readable keys cannot store, before any
// statement.
func checkKeyLen(mode ratelimit.KeyMode, key string) error {
	if mode == ratelimit.ReadableKeys && len(key) > ratelimit.MaxReadableKeyBytes {
		return usagef("the key has %d bytes, and readable keys hold at most %d: no counter can be stored under it", len(key), ratelimit.MaxReadableKeyBytes)
	}
	return nil
}

// limiter builds t's limiter on tx: it only peeks, so it has no deny cache,
// no coalescing, and returns the database's errors instead of answering
// from memory.
func (t keyTarget) limiter(tx pgx.Tx) (*ratelimit.Limiter, ratelimit.Config, error) {
	cfg := t.cfg
	cfg.OnFailure, cfg.DenyCacheSize = ratelimit.FailError, -1
	// One transaction serves one statement at a time: no coalescing.
	rdb, err := ratelimit.NewDatabase(tx, ratelimit.DatabaseOptions{DisableCoalescing: true})
	if err != nil {
		return nil, cfg, err
	}
	lim, err := rdb.Limiter(cfg)
	if err != nil {
		if t.source == "policy" {
			return nil, cfg, fmt.Errorf("%w: policy %q as stored: %w", policy.ErrInvalid, cfg.Name, err)
		}
		return nil, cfg, usagef("the limiter these flags describe is not valid: %v", err)
	}
	return lim, lim.Config(), nil
}

// storedKeys are the key column's values of key's counter rows under cfg
// (defaults filled in): one row, or with Spread one per row of the limit,
// named as the library names them.
func storedKeys(cfg ratelimit.Config, key string) [][]byte {
	counterName := func(name string) string {
		if cfg.KeyByWindow && cfg.Algorithm != ratelimit.TokenBucket {
			return ratelimit.RateName(name, cfg.Window)
		}
		return name
	}
	if cfg.Spread <= 1 {
		return [][]byte{ratelimit.StoredKey(cfg.KeyMode, counterName(cfg.Name), key)}
	}
	out := make([][]byte, cfg.Spread)
	for i := range out {
		out[i] = ratelimit.StoredKey(cfg.KeyMode, counterName(fmt.Sprintf("%s#%d", cfg.Name, i)), key)
	}
	return out
}

// counterTable is the table that holds alg's counters.
func counterTable(alg ratelimit.Algorithm) string {
	switch alg {
	case ratelimit.TokenBucket:
		return "pgrl_token_bucket"
	case ratelimit.SlidingWindow:
		return "pgrl_sliding_window"
	}
	return "pgrl_fixed_window"
}

// countRows counts the rows stored under keys, expired windows that
// rl-cleanup has not removed yet included: what reset would delete.
func countRows(ctx context.Context, tx pgx.Tx, alg ratelimit.Algorithm, keys [][]byte) (int64, error) {
	var n int64
	err := tx.QueryRow(ctx, `SELECT count(*) FROM `+counterTable(alg)+` WHERE key = ANY($1::bytea[])`, keys).Scan(&n)
	return n, err
}

func (a *app) keyGet(ctx context.Context, tx pgx.Tx, t keyTarget, key string) error {
	lim, cfg, err := t.limiter(tx)
	if err != nil {
		return err
	}
	d, err := lim.PeekTx(ctx, tx, key)
	if err != nil {
		return err
	}
	keys := storedKeys(cfg, key)
	rows, err := countRows(ctx, tx, cfg.Algorithm, keys)
	if err != nil {
		return err
	}
	if a.json() {
		out := keyJSON("key get", t, cfg, key, keys)
		out["counter"] = map[string]any{
			"exists": rows > 0, "rows": rows,
			"allowed": d.Allowed, "used": d.Used, "remaining": d.Remaining, "limit": d.Limit,
			"reset_at": d.ResetAt.UTC().Format(time.RFC3339Nano), "reset_after_seconds": d.ResetAfter().Seconds(),
			"retry_after_seconds": d.RetryAfterSeconds(), "now": d.Now.UTC().Format(time.RFC3339Nano),
		}
		return cli.PrintJSON(a.stdout, out)
	}
	a.keyHeader(t, cfg, key, keys)
	state := "allowed"
	if !d.Allowed {
		state = fmt.Sprintf("denied, retry after %ds", d.RetryAfterSeconds())
	}
	fmt.Fprintf(a.stdout, "counter    used %d of %d, %d remaining, resets at %s (in %s): next check %s\n",
		d.Used, d.Limit, d.Remaining, d.ResetAt.UTC().Format(time.RFC3339), d.ResetAfter().Round(time.Second), state)
	if rows == 0 {
		fmt.Fprintln(a.stdout, "rows       none stored: the key is as a key never seen")
	} else {
		fmt.Fprintf(a.stdout, "rows       %s stored in %s (`rl-policy key reset` deletes them)\n", plural(int(rows), "row", "rows"), counterTable(cfg.Algorithm))
	}
	return nil
}

func (a *app) keyReset(ctx context.Context, tx pgx.Tx, t keyTarget, key string) error {
	_, cfg, err := t.limiter(tx)
	if err != nil {
		return err
	}
	keys := storedKeys(cfg, key)
	q := gen.New()
	var deleted int64
	for _, k := range keys {
		var n int64
		switch cfg.Algorithm {
		case ratelimit.TokenBucket:
			n, err = q.TokenBucketReset(ctx, tx, k)
		case ratelimit.SlidingWindow:
			n, err = q.SlidingWindowReset(ctx, tx, k)
		default:
			n, err = q.FixedWindowReset(ctx, tx, k)
		}
		if err != nil {
			return err
		}
		deleted += n
	}
	if a.json() {
		out := keyJSON("key reset", t, cfg, key, keys)
		out["existed"], out["deleted_rows"] = deleted > 0, deleted
		return cli.PrintJSON(a.stdout, out)
	}
	a.keyHeader(t, cfg, key, keys)
	if deleted == 0 {
		fmt.Fprintln(a.stdout, "reset      nothing to delete: the key had no counter row")
	} else {
		fmt.Fprintf(a.stdout, "reset      deleted %s from %s: the next check counts from zero (a denial a process has cached stays until it ends)\n",
			plural(int(deleted), "row", "rows"), counterTable(cfg.Algorithm))
	}
	return nil
}

// keyHeader prints the limiter and the key, in text.
func (a *app) keyHeader(t keyTarget, cfg ratelimit.Config, key string, keys [][]byte) {
	from := "defined in code (from the flags)"
	if t.source == "policy" {
		from = "stored policy"
	}
	fmt.Fprintf(a.stdout, "limiter    %s, %s: %s\n", cfg.Name, from, shapeText(cfg))
	switch {
	case t.override != nil:
		fmt.Fprintf(a.stdout, "override   %s\n", describeOverride(*t.override, *t.policy))
	case t.ignored != "":
		fmt.Fprintf(a.stdout, "override   ignored: %s\n", t.ignored)
	}
	hexes := make([]string, len(keys))
	for i, k := range keys {
		hexes[i] = hex.EncodeToString(k)
	}
	fmt.Fprintf(a.stdout, "key        %s (stored as %s)\n", keyShown(key), strings.Join(hexes, ", "))
}

// shapeText describes cfg (defaults filled in) in one line.
func shapeText(cfg ratelimit.Config) string {
	s := fmt.Sprintf("%s, %d per %s", cfg.Algorithm, cfg.Limit, cfg.Window)
	if cfg.Algorithm == ratelimit.TokenBucket {
		s += fmt.Sprintf(", burst %d", cfg.Burst)
	}
	s += ", " + keyModeText(cfg.KeyMode) + " keys"
	if cfg.KeyByWindow && cfg.Algorithm != ratelimit.TokenBucket {
		s += ", keyed by window"
	}
	if cfg.Spread > 1 {
		s += fmt.Sprintf(", spread over %d rows", cfg.Spread)
	}
	return s
}

// keyShown is key quoted when it is printable text, else in hexadecimal.
func keyShown(key string) string {
	if utf8.ValidString(key) && strings.IndexFunc(key, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 && key != "" {
		return strconv.Quote(key)
	}
	return "hex " + hex.EncodeToString([]byte(key))
}

// keyJSON is what both key commands print about the limiter and the key.
func keyJSON(command string, t keyTarget, cfg ratelimit.Config, key string, keys [][]byte) map[string]any {
	var burst any
	if cfg.Algorithm == ratelimit.TokenBucket {
		burst = cfg.Burst
	}
	var text any
	if utf8.ValidString(key) {
		text = key
	}
	hexes := make([]string, len(keys))
	for i, k := range keys {
		hexes[i] = hex.EncodeToString(k)
	}
	out := map[string]any{
		"command": command, "name": cfg.Name, "source": t.source,
		"limiter": map[string]any{
			"algorithm": string(cfg.Algorithm), "limit": cfg.Limit, "window": cfg.Window.String(),
			"window_seconds": cfg.Window.Seconds(), "burst": burst, "key_mode": keyModeText(cfg.KeyMode),
			"key_by_window": cfg.KeyByWindow, "spread": cfg.Spread,
		},
		"key": text, "key_hex": hex.EncodeToString([]byte(key)),
		"stored_key_hex": hexes[0], "stored_keys_hex": hexes,
		"table": counterTable(cfg.Algorithm), "override": nil,
	}
	if t.override != nil && t.policy != nil {
		out["override"] = overrideJSON(*t.override, *t.policy)
	}
	return out
}
