package gen

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// maxSQLColumns is the longest line a SQL file under sql/ may have.
const maxSQLColumns = 120

// frozenMigrations were released before the limit existed; migrations are
// never edited once users have applied them, so they keep their lines.
var frozenMigrations = map[string]bool{
	"000001_counters.up.sql": true, "000001_counters.down.sql": true,
	"000002_partitioning.up.sql": true, "000002_partitioning.down.sql": true,
	"000003_multi_limit.up.sql": true, "000003_multi_limit.down.sql": true,
	"000004_partition_bounds.up.sql": true, "000004_partition_bounds.down.sql": true,
}

// TestSQLLineLength: no line of a SQL file under sql/ (queries, internal
// queries, migrations from 000005 on) is longer than maxSQLColumns.
func TestSQLLineLength(t *testing.T) {
	var files []string
	require.NoError(t, filepath.WalkDir("../sql", func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".sql") && !frozenMigrations[d.Name()] {
			files = append(files, path)
		}
		return err
	}))
	require.GreaterOrEqual(t, len(files), 8, "SQL files not found under ../sql")
	for _, path := range files {
		f, err := os.Open(path)
		require.NoError(t, err)
		sc := bufio.NewScanner(f)
		for n := 1; sc.Scan(); n++ {
			if cols := len([]rune(sc.Text())); cols > maxSQLColumns {
				t.Errorf("%s:%d is %d columns long, more than %d", path, n, cols, maxSQLColumns)
			}
		}
		require.NoError(t, sc.Err())
		require.NoError(t, f.Close())
	}
}
