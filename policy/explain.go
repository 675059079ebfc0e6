package policy

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/ratelimit"
)

// Explanation says which limit applies to a key of a policy and what the
// key has used: the answer to "why was this client limited?".
type Explanation struct {
	// Policy is the policy as stored.
	Policy Policy
	// Key is the key as the caller gives it; StoredKey its stored form,
	// the value of pgrl_policy_override.key and of the counters' key.
	Key       string
	StoredKey []byte
	// Override is the key's override when one is in force, else nil.
	Override *Override
	// Expired is the key's override when it has expired (it no longer
	// applies; delete it or set a new expiry), else nil.
	Expired *Override
	// Ignored says why the key's override, in force, is not applied: the
	// policy no longer admits its rate (for instance a burst too large for
	// a new algorithm). Empty otherwise.
	Ignored string
	// Rate is the rate that applies (Burst filled in).
	Rate ratelimit.Rate
	// Counter is the key's counter under that rate, as a check of one unit
	// would see it now (Peek): nothing is counted.
	Counter ratelimit.Decision
}

// Explain reads the policy named name and key's override straight from
// the database (not from a Cache), and peeks at key's counter with the rate
// that applies. ErrNotFound when the policy does not exist. The peek is
// that of a limiter with the policy's configuration and no Spread: for an
// application that spreads the policy over several rows (Config.Spread),
// use its Limiter's Peek instead.
func Explain(ctx context.Context, db DB, name, key string) (Explanation, error) {
	p, err := Get(ctx, db, name)
	if err != nil {
		return Explanation{}, err
	}
	x := Explanation{Policy: p, Key: key, StoredKey: p.StoredKey(key), Rate: p.Rate()}
	var inForce bool
	row := db.QueryRow(ctx, `SELECT `+overrideColumns+`, expires_at IS NULL OR expires_at > now()
  FROM pgrl_policy_override WHERE policy = $1 AND key = $2`, name, x.StoredKey)
	o, err := scanOverrideWith(row, &inForce)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return Explanation{}, explainRead(ctx, db, err)
	case !inForce:
		x.Expired = &o
	default:
		if verr := o.Validate(p); verr != nil {
			x.Ignored = verr.Error()
		} else {
			x.Override = &o
			x.Rate = o.Rate(p)
		}
	}
	if x.Rate.Burst == 0 {
		x.Rate.Burst = x.Rate.Limit
	}
	rdb, err := ratelimit.NewDatabase(db, ratelimit.DatabaseOptions{DisableCoalescing: true})
	if err != nil {
		return Explanation{}, err
	}
	lim, err := rdb.Limiter(p.Config(ratelimit.Config{OnFailure: ratelimit.FailError, DenyCacheSize: -1}))
	if err != nil {
		return Explanation{}, invalid(err, "policy %q as stored", name)
	}
	x.Counter, err = lim.Peek(ctx, key, ratelimit.AtRate(x.Rate))
	if err != nil {
		return Explanation{}, err
	}
	return x, nil
}

// scanOverrideWith is scanOverride with one more boolean column.
func scanOverrideWith(row pgx.Row, extra *bool) (Override, error) {
	var o Override
	dest, done := overrideFields(&o)
	if err := row.Scan(append(dest, extra)...); err != nil {
		return Override{}, err
	}
	done()
	return o, nil
}
