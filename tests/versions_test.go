package tests

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// pinnedMajors reads scripts/pg-versions.txt, the list CI tests (.ci/run
// runs scripts/matrix.sh, which takes its majors from it): each major and
// the server minor its pinned package carries ("13.23" for 13.23.0-beta.16).
func pinnedMajors(t *testing.T) map[int]string {
	t.Helper()
	f, err := os.Open("../scripts/pg-versions.txt")
	require.NoError(t, err)
	defer f.Close()
	majors := map[int]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		require.Len(t, fields, 3, "line %q: want MAJOR VERSION INTEGRITY", line)
		major, err := strconv.Atoi(fields[0])
		require.NoError(t, err, "line %q", line)
		parts := strings.SplitN(fields[1], ".", 3)
		require.Equal(t, fields[0], parts[0], "line %q: the package version starts with its major", line)
		require.True(t, strings.HasPrefix(fields[2], "sha512-"), "line %q: an npm integrity hash", line)
		majors[major] = parts[0] + "." + parts[1]
	}
	require.NoError(t, sc.Err())
	return majors
}

// TestREADMESupportTableMatchesCI fails when the README's table of
// supported PostgreSQL versions names a major (or a minor) that CI does not
// test, or misses one it does, and when CI stops taking its majors from
// that same list.
func TestREADMESupportTableMatchesCI(t *testing.T) {
	pinned := pinnedMajors(t)
	require.NotEmpty(t, pinned)

	body, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	readme := string(body)
	start := strings.Index(readme, "### Supported PostgreSQL versions")
	require.NotEqual(t, -1, start, "the README has a support table")
	section := readme[start:]
	if end := strings.Index(section[4:], "\n#"); end != -1 {
		section = section[:end+4]
	}
	row := regexp.MustCompile(`(?m)^\| (\d+) \| (\d+\.\d+) \|`)
	claimed := map[int]string{}
	for _, m := range row.FindAllStringSubmatch(section, -1) {
		major, _ := strconv.Atoi(m[1])
		claimed[major] = m[2]
	}
	require.Equal(t, pinned, claimed, "README support table (major → tested minor) against scripts/pg-versions.txt")

	// The range the README states in prose is the table's.
	var majors []int
	for m := range pinned {
		majors = append(majors, m)
	}
	slices.Sort(majors)
	require.Contains(t, readme, fmt.Sprintf("PostgreSQL (%d to %d)", majors[0], majors[len(majors)-1]))

	// CI runs the matrix, and the matrix takes its majors from the list.
	ci, err := os.ReadFile("../.ci/run")
	require.NoError(t, err)
	require.Contains(t, string(ci), "bash scripts/matrix.sh", ".ci/run runs the matrix")
	matrix, err := os.ReadFile("../scripts/matrix.sh")
	require.NoError(t, err)
	require.Contains(t, string(matrix), "bash scripts/pg.sh versions", "the matrix reads scripts/pg-versions.txt")
}
