package tests

// The cleanup recipes of README.md and docs/SECURITY.md, run as written: the
// grants exactly as documented, given to a fresh role, and the README's cron
// job run as cron runs it, with no environment but the crontab's.

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// docSection returns the text of path from the line that is heading up to
// the next heading of the same level or higher (outside code blocks).
func docSection(t *testing.T, path, heading string) string {
	t.Helper()
	body, err := os.ReadFile(path)
	require.NoError(t, err)
	level := len(heading) - len(strings.TrimLeft(heading, "#"))
	var out []string
	in, fenced := false, false
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		if in && !fenced && strings.HasPrefix(line, "#") {
			l := len(line) - len(strings.TrimLeft(line, "#"))
			if l <= level && strings.HasPrefix(line[l:], " ") {
				break
			}
		}
		if strings.HasPrefix(line, heading) && strings.TrimSpace(line) == heading {
			in = true
		}
		if in {
			out = append(out, line)
		}
	}
	require.True(t, in, "%s has no section %q", path, heading)
	return strings.Join(out, "\n")
}

// fencedBlocks returns the bodies of the ```lang blocks of text, in order.
func fencedBlocks(text, lang string) []string {
	re := regexp.MustCompile("(?s)```" + regexp.QuoteMeta(lang) + "\n(.*?)```")
	var blocks []string
	for _, m := range re.FindAllStringSubmatch(text, -1) {
		blocks = append(blocks, m[1])
	}
	return blocks
}

// sqlStatements splits a block of SQL into statements, without comments.
func sqlStatements(block string) []string {
	var lines []string
	for _, l := range strings.Split(block, "\n") {
		if i := strings.Index(l, "--"); i >= 0 {
			l = l[:i]
		}
		lines = append(lines, l)
	}
	var stmts []string
	for _, s := range strings.Split(strings.Join(lines, "\n"), ";") {
		if s = strings.Join(strings.Fields(s), " "); s != "" {
			stmts = append(stmts, s)
		}
	}
	return stmts
}

// docNames maps the names the docs use to this test's.
func (rs roleSetup) docNames(s string) string {
	s = regexp.MustCompile(`\bratelimit\b`).ReplaceAllString(s, pgx.Identifier{rs.schema}.Sanitize())
	s = regexp.MustCompile(`\bpgrl_cleanup\b`).ReplaceAllString(s, pgx.Identifier{rs.cleaner}.Sanitize())
	return regexp.MustCompile(`\bpgrl_owner\b`).ReplaceAllString(s, pgx.Identifier{rs.owner}.Sanitize())
}

// applyDocGrants runs the documented statements as the superuser, with the
// doc's names replaced by the test's. CREATE ROLE is skipped: the roles
// exist already (newRoleSetup), with no rights.
func applyDocGrants(t *testing.T, rs roleSetup, stmts []string) {
	t.Helper()
	require.NotEmpty(t, stmts)
	for _, stmt := range stmts {
		if strings.HasPrefix(strings.ToUpper(stmt), "CREATE ROLE ") {
			continue
		}
		require.True(t, strings.HasPrefix(strings.ToUpper(stmt), "GRANT "), "not a grant: %s", stmt)
		_, err := dbtest.Admin(t).Exec(context.Background(), rs.docNames(stmt))
		require.NoError(t, err, stmt)
	}
}

// insertDeadRows inserts one expired row in each table delete mode cleans.
func insertDeadRows(t *testing.T, rs roleSetup) {
	t.Helper()
	s := pgx.Identifier{rs.schema}.Sanitize()
	for _, stmt := range []string{
		"INSERT INTO " + s + ".pgrl_fixed_window SELECT '\\x01', now() - interval '1 hour', 1, true",
		"INSERT INTO " + s + ".pgrl_sliding_window SELECT '\\x01', now() - interval '3 hours', 1, 0, now() - interval '1 hour', true",
	} {
		_, err := dbtest.Admin(t).Exec(context.Background(), stmt)
		require.NoError(t, err, stmt)
	}
}

// cleanupJSON is the part of rl-cleanup's JSON result these tests read.
type cleanupJSON struct {
	Mode   string `json:"mode"`
	Tables map[string]struct {
		Deleted int64 `json:"deleted"`
	} `json:"tables"`
	Partitions *struct {
		Created int `json:"created"`
	} `json:"partitions"`
	Error string `json:"error"`
}

// runCleanupAs runs rl-cleanup as role on the test schema, with JSON output.
func runCleanupAs(t *testing.T, bin string, rs roleSetup, role string, args ...string) cleanupJSON {
	t.Helper()
	args = append([]string{"--database-url", dbtest.URLAs(role), "--schema", rs.schema, "--output", "json"}, args...)
	cmd := exec.Command(bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	require.NoError(t, err, "rl-cleanup %v: %s %s", args, out.String(), errb.String())
	var res cleanupJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &res), out.String())
	return res
}

// README's rl-cleanup section: its grants, exactly, let the cleanup role run
// its cron job (delete mode, plain layout), and with the line for partition
// mode, partition mode. The cron job runs as cron runs it: env -i with the
// crontab's variables only (its DATABASE_URL replaced by the test
// database's, as the cleanup role), through /bin/sh.
func TestREADMECleanupRecipeRunsAsWritten(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-cleanup")
	section := docSection(t, "../README.md", "## rl-cleanup")
	sqlBlocks := fencedBlocks(section, "sql")
	require.Len(t, sqlBlocks, 1, "README's rl-cleanup section has one block of grants")
	cronBlocks := fencedBlocks(section, "cron")
	require.Len(t, cronBlocks, 1, "README's rl-cleanup section has one crontab")

	var deleteGrants, partitionGrants []string
	for _, stmt := range sqlStatements(sqlBlocks[0]) {
		if strings.Contains(stmt, "pgrl_owner TO") {
			partitionGrants = append(partitionGrants, stmt)
		} else {
			deleteGrants = append(deleteGrants, stmt)
		}
	}
	require.NotEmpty(t, partitionGrants, "the README names partition mode's grant")

	rs := newRoleSetup(t)
	applyDocGrants(t, rs, deleteGrants)
	insertDeadRows(t, rs)

	// The crontab: variable lines, then the job line.
	var env []string
	var job string
	for _, line := range strings.Split(cronBlocks[0], "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`).MatchString(line):
			env = append(env, line)
		default:
			require.Empty(t, job, "one job line in README's crontab")
			m := regexp.MustCompile(`^(\S+\s+){5}(.+)$`).FindStringSubmatch(line)
			require.NotNil(t, m, "not a cron job line: %s", line)
			job = m[2]
		}
	}
	require.NotEmpty(t, job)
	logDir := t.TempDir()
	cronEnv := []string{"HOME=" + t.TempDir(), "SHELL=/bin/sh"}
	for _, kv := range env {
		name, value, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(value, "postgres://") || strings.HasPrefix(value, "postgresql://"):
			value = dbtest.URLAs(rs.cleaner)
		case name == "PATH":
			// The binary stands where the README installs it.
			value = filepath.Dir(bin) + ":" + value
		}
		cronEnv = append(cronEnv, name+"="+value)
	}
	job = regexp.MustCompile(`--database-url[ =]\S+`).ReplaceAllString(job, "--database-url "+dbtest.URLAs(rs.cleaner))
	job = strings.ReplaceAll(job, "/var/log/", logDir+"/")
	job = rs.docNames(job)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "env", append(append([]string{"-i"}, cronEnv...), "/bin/sh", "-c", job)...)
	out, err := cmd.CombinedOutput()
	logs, _ := os.ReadFile(filepath.Join(logDir, "rl-cleanup.log"))
	result, rerr := os.ReadFile(filepath.Join(logDir, "rl-cleanup.json"))
	require.NoError(t, err, "cron job %q: %s; result: %s; log: %s", job, out, result, logs)
	require.NoError(t, rerr, "the job writes its JSON result where the README says")
	var res cleanupJSON
	dec := json.NewDecoder(bytes.NewReader(result))
	require.NoError(t, dec.Decode(&res), "%s", result)
	require.False(t, dec.More(), "one JSON object per run: %s", result)
	require.Empty(t, res.Error)
	require.Equal(t, "delete", res.Mode)
	require.Equal(t, int64(1), res.Tables["pgrl_fixed_window"].Deleted, "%s", result)
	require.Equal(t, int64(1), res.Tables["pgrl_sliding_window"].Deleted, "%s", result)

	// Delete mode on the partitioned layout needs no more.
	_, err = rs.migrator(t, migration.Config{PartitionLookahead: 2 * time.Hour}).SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	runCleanupAs(t, bin, rs, rs.cleaner)

	// Partition mode with its documented grant.
	applyDocGrants(t, rs, partitionGrants)
	res = runCleanupAs(t, bin, rs, rs.cleaner, "--partitions", "--horizon", "5h")
	require.NotNil(t, res.Partitions)
	require.GreaterOrEqual(t, res.Partitions.Created, 2)
}

// docs/SECURITY.md's cleanup role: its first block (delete mode) is enough
// for delete mode in both layouts, and with its second (partition mode) the
// role runs partition mode.
func TestSecurityDocCleanupRoleBothModes(t *testing.T) {
	t.Parallel()
	bin := buildCommand(t, "github.com/pgrl/pgrl/cmd/rl-cleanup")
	blocks := fencedBlocks(docSection(t, "../docs/SECURITY.md", "## 3. The cleanup role"), "sql")
	require.Len(t, blocks, 2, "docs/SECURITY.md's cleanup role: a block for delete mode, one for partition mode")
	rs := newRoleSetup(t)
	applyDocGrants(t, rs, sqlStatements(blocks[0]))
	insertDeadRows(t, rs)
	res := runCleanupAs(t, bin, rs, rs.cleaner)
	require.Equal(t, int64(1), res.Tables["pgrl_fixed_window"].Deleted)
	require.Equal(t, int64(1), res.Tables["pgrl_sliding_window"].Deleted)

	ctx := context.Background()
	_, err := rs.migrator(t, migration.Config{PartitionLookahead: 2 * time.Hour}).SetLayout(ctx, migration.LayoutPartitioned, time.Hour)
	require.NoError(t, err)
	runCleanupAs(t, bin, rs, rs.cleaner)

	applyDocGrants(t, rs, sqlStatements(blocks[1]))
	res = runCleanupAs(t, bin, rs, rs.cleaner, "--partitions", "--horizon", "5h")
	require.NotNil(t, res.Partitions)
	require.GreaterOrEqual(t, res.Partitions.Created, 2)
}

// Every crontab in the docs says which database its jobs clean: a
// DATABASE_URL line in the block, or --database-url with a literal value in
// the job (cron sets no variable of the user's shell).
func TestCrontabsNameTheirDatabase(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"../README.md", "../docs/CLEANUP.md"} {
		body, err := os.ReadFile(path)
		require.NoError(t, err)
		blocks := fencedBlocks(string(body), "cron")
		require.NotEmpty(t, blocks, path)
		for _, b := range blocks {
			hasURL := regexp.MustCompile(`(?m)^DATABASE_URL=postgres`).MatchString(b) ||
				regexp.MustCompile(`--database-url[ =]["']?postgres`).MatchString(b)
			require.True(t, hasURL, "%s: a crontab that names no database URL:\n%s", path, b)
		}
	}
}
