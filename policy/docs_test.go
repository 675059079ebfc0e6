package policy_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/policy"
	"github.com/pgrl/pgrl/ratelimit"
)

// docSQL returns the SQL blocks of the section of docs/POLICIES.md whose
// heading starts with heading, split into statements (comment lines
// dropped).
func docSQL(t *testing.T, heading string) [][]string {
	t.Helper()
	doc, err := os.ReadFile("../docs/POLICIES.md")
	require.NoError(t, err)
	s := string(doc)
	i := strings.Index(s, "\n"+heading)
	require.NotEqual(t, -1, i, "docs/POLICIES.md has no section %q", heading)
	s = s[i+1:]
	if j := regexp.MustCompile(`\n#{1,3} `).FindStringIndex(s[len(heading):]); j != nil {
		s = s[:len(heading)+j[0]]
	}
	var blocks [][]string
	for _, m := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(s, -1) {
		var lines []string
		for _, l := range strings.Split(m[1], "\n") {
			if !strings.HasPrefix(strings.TrimSpace(l), "--") {
				lines = append(lines, l)
			}
		}
		var stmts []string
		for _, st := range strings.Split(strings.Join(lines, "\n"), ";") {
			if st = strings.TrimSpace(st); st != "" {
				stmts = append(stmts, st)
			}
		}
		blocks = append(blocks, stmts)
	}
	return blocks
}

// The recipe of docs/POLICIES.md, section "Keys": the raw key is refused as
// it says, the row written with pgrl_policy_key applies, and the queries
// for rows written before migration 000008 find such a row and make it
// apply.
func TestDocsKeyRecipe(t *testing.T) {
	t.Parallel()
	pool, _ := dbtest.Pool(t)
	ctx := context.Background()
	_, err := policy.Set(ctx, pool, policy.Policy{Name: "api", Limit: 2, Window: time.Hour})
	require.NoError(t, err)
	blocks := docSQL(t, "### Keys: write them with `pgrl_policy_key`")
	require.Len(t, blocks, 3)
	require.Len(t, blocks[0], 2, "the refused INSERT and the recipe")

	_, err = pool.Exec(ctx, blocks[0][0])
	requireConstraint(t, err, "pgrl_policy_override_key_mode_check")
	_, err = pool.Exec(ctx, blocks[0][1])
	require.NoError(t, err, blocks[0][1])
	lim, err := newLimiter(ctx, pool, "api", policy.Options{})
	require.NoError(t, err)
	for i := 1; i <= 6; i++ {
		d, err := lim.Allow(ctx, "tenant-9")
		require.NoError(t, err)
		require.Equal(t, i <= 5, d.Allowed, "check %d: the recipe's override gives tenant-9 a limit of 5", i)
	}

	// A row from before the check (written here with the trigger off).
	_, err = pool.Exec(ctx, `ALTER TABLE pgrl_policy_override DISABLE TRIGGER pgrl_policy_override_key_mode_check`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('api', 'tenant-7', 4)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ALTER TABLE pgrl_policy_override ENABLE TRIGGER pgrl_policy_override_key_mode_check`)
	require.NoError(t, err)
	require.Len(t, blocks[1], 2, "the SELECT that finds old rows and the UPDATE that rewrites them")
	var meant []string
	rows, err := pool.Query(ctx, blocks[1][0])
	require.NoError(t, err)
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		meant = append(meant, vals[2].(string))
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"tenant-7"}, meant)
	tag, err := pool.Exec(ctx, blocks[1][1])
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected())
	x, err := policy.Explain(ctx, pool, "api", "tenant-7")
	require.NoError(t, err)
	require.NotNil(t, x.Override, "the rewritten row applies")
	require.Equal(t, int64(4), x.Rate.Limit)

	// A readable key too long to apply, from before migration 000009.
	_, err = policy.Set(ctx, pool, policy.Policy{Name: "login", Limit: 2, Window: time.Hour, KeyMode: ratelimit.ReadableKeys})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ALTER TABLE pgrl_policy_override DISABLE TRIGGER pgrl_policy_override_key_mode_check`)
	require.NoError(t, err)
	for _, n := range []int{ratelimit.MaxReadableKeyBytes, ratelimit.MaxReadableKeyBytes + 1} {
		_, err = pool.Exec(ctx, `INSERT INTO pgrl_policy_override (policy, key, "limit") VALUES ('login', pgrl_policy_key('login', $1), 4)`,
			strings.Repeat("k", n))
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `ALTER TABLE pgrl_policy_override ENABLE TRIGGER pgrl_policy_override_key_mode_check`)
	require.NoError(t, err)
	require.Len(t, blocks[2], 1, "the SELECT of readable keys too long to apply")
	var policies []string
	var lengths []int32
	rows, err = pool.Query(ctx, blocks[2][0])
	require.NoError(t, err)
	for rows.Next() {
		var name string
		var n int32
		require.NoError(t, rows.Scan(&name, &n))
		policies, lengths = append(policies, name), append(lengths, n)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"login"}, policies)
	require.Equal(t, []int32{ratelimit.MaxReadableKeyBytes + 1}, lengths)
}

// The package doc describes the default: checks read the policy tables in
// their own statement, and only FromCache keeps them off the request path.
func TestPackageDocDescribesTheDefault(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("policy.go")
	require.NoError(t, err)
	doc := string(src[:strings.Index(string(src), "\npackage policy")])
	doc = strings.Join(strings.Fields(strings.ReplaceAll(doc, "//", "")), " ")
	require.NotContains(t, doc, "never queries the policy tables")
	require.Contains(t, doc, "By default each check reads the policy and the key's override in the one statement that counts")
	require.Contains(t, doc, "With Options.FromCache, checks use the policy and override as last loaded into the Cache")
	require.False(t, policy.Options{}.FromCache, "the default is the statement's read")
}

// A plan's lines show what changes, even what Summary leaves out.
func TestPlanShowsHiddenChanges(t *testing.T) {
	t.Parallel()
	stored := []policy.Policy{{Name: "api", Algorithm: "fixed_window", Limit: 5, Window: time.Minute, Description: "old"}}
	for _, tc := range []struct {
		want policy.Policy
		line string
	}{
		{policy.Policy{Name: "api", Limit: 5, Window: time.Minute, Description: "new"},
			`update api: description "old" -> "new" (limit unchanged: fixed_window, 5 per 1m0s, hashed keys)`},
		{policy.Policy{Name: "api", Limit: 5, Window: time.Minute, Burst: 9, Description: "old"},
			`update api: burst =limit -> 9 (used by token_bucket only) (limit unchanged: fixed_window, 5 per 1m0s, hashed keys)`},
		{policy.Policy{Name: "api", Limit: 6, Window: time.Minute, Description: "old"},
			`update api: fixed_window, 5 per 1m0s, hashed keys -> fixed_window, 6 per 1m0s, hashed keys`},
		{policy.Policy{Name: "new", Limit: 6, Window: time.Minute, Description: "for bots"},
			`create new: fixed_window, 6 per 1m0s, hashed keys; description "for bots"`},
	} {
		changes, err := policy.Plan(stored, []policy.Policy{tc.want}, false)
		require.NoError(t, err)
		require.Len(t, changes, 1)
		require.Equal(t, tc.line, changes[0].String())
	}
}
