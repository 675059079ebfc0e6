package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/cli"
	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// TestCitusUpAndStatus: on Citus, `up --schema` distributes pgrl's tables
// once (the second up reports none), and status shows each table's
// distribution in text and in JSON.
func TestCitusUpAndStatus(t *testing.T) {
	if ok, err := migration.HasCitus(context.Background(), dbtest.Admin(t)); err != nil || !ok {
		t.Skip("the test database has no citus extension (see scripts/citus.sh)")
	}
	s := dbtest.NewSchema(t)
	stdout, stderr, code := runFn(t, db(s, "--output", "json", "up")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	res := oneJSON(t, stdout)
	require.Len(t, res["distributed"], len(migration.DistributedTables)+len(migration.ReferenceTables))

	stdout, stderr, code = runFn(t, db(s, "--output", "json", "up")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	res = oneJSON(t, stdout)
	require.Nil(t, res["distributed"], "a second up distributes nothing")

	stdout, stderr, code = runFn(t, db(s, "--output", "json", "status")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	st := oneJSON(t, stdout)
	require.Equal(t, true, st["citus"])
	kinds := map[string]string{}
	for _, d := range st["distribution"].([]any) {
		m := d.(map[string]any)
		kinds[m["table"].(string)] = m["kind"].(string)
		if m["kind"] == migration.DistributionDistributed {
			require.Equal(t, "key", m["column"])
			require.Positive(t, m["shards"])
		}
	}
	for _, table := range migration.DistributedTables {
		require.Equal(t, migration.DistributionDistributed, kinds[table], table)
	}
	for _, table := range migration.ReferenceTables {
		require.Equal(t, migration.DistributionReference, kinds[table], table)
	}
	for _, table := range migration.CoordinatorTables {
		require.Equal(t, migration.DistributionLocal, kinds[table], table)
	}

	stdout, stderr, code = runFn(t, db(s, "status")...)
	require.Equal(t, cli.ExitOK, code, stderr)
	require.Contains(t, stdout, "citus:            yes")
	require.Regexp(t, `pgrl_token_bucket\s+distributed by key, \d+ shards`, stdout)
	require.Regexp(t, `pgrl_partition_settings\s+reference`, stdout)
	require.Regexp(t, `pgrl_policy\s+local`, stdout)
}
