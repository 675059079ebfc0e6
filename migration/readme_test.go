package migration_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's Go snippets for package migration are runnable examples:
// each is a run of lines of an Example function's body in example_test.go,
// which compiles and runs against the test database. And no Go expression
// in the README calls a method on New's two results at once, which does not
// compile.
func TestREADMEMigrationSnippets(t *testing.T) {
	t.Parallel()
	body, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	readme := string(body)
	require.NotRegexp(t, `migration\.New(WithConnConfig)?\([^()]*(\([^()]*\))*[^()]*\)\.`, readme,
		"migration.New returns (*Migrator, error): a method cannot be called on it directly")

	start := strings.Index(readme, "### From Go")
	require.NotEqual(t, -1, start, "the README has a From Go section")
	section := readme[start:]
	if end := strings.Index(section, "\n## "); end != -1 {
		section = section[:end]
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(section, -1)
	require.Len(t, blocks, 2, "the From Go section's snippets")

	src, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	bodies := map[string]string{}
	for _, m := range regexp.MustCompile(`(?s)\nfunc (Example\w+)\(\) \{\n(.*?)\n\}\n`).FindAllStringSubmatch(string(src), -1) {
		var lines []string
		for _, l := range strings.Split(m[2], "\n") {
			if strings.TrimSpace(l) == "// Output:" {
				break
			}
			lines = append(lines, strings.TrimPrefix(l, "\t"))
		}
		bodies[m[1]] = strings.Join(lines, "\n") + "\n"
	}
	for i, want := range []string{"ExampleMigrator_Up", "ExampleMigrator_Check"} {
		require.Contains(t, bodies, want)
		require.Contains(t, bodies[want], blocks[i][1], "README snippet %d is a part of %s's body", i+1, want)
	}
	// The first is the whole of its example but the context.
	require.Equal(t, "ctx := context.Background()\n"+blocks[0][1], bodies["ExampleMigrator_Up"])
}
