package tests

import (
	"bufio"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.yaml.in/yaml/v3"

	"github.com/pgrl/pgrl/internal/dbtest"
)

// The deploy recipes in deploy/ (Kubernetes, systemd, GitHub Actions, the
// Dockerfile) name rl-migrate and rl-cleanup commands and flags. These
// tests parse every recipe, collect each invocation, and check every
// command and flag against the built binaries' --help, so the recipes
// cannot drift from the code.

// cliSpec is what a command's --help says it accepts.
type cliSpec struct {
	name     string
	commands map[string]bool // subcommands; empty for a command without any
	flags    map[string]bool // flag name -> takes a value
}

// invocation is one call of a command found in a recipe.
type invocation struct {
	where string // file and place, for messages
	bin   string // base name of the program
	args  []string
	// cred names where the command's DATABASE_URL comes from: the
	// Kubernetes secret, the Actions secret expression or the systemd
	// EnvironmentFile; empty when the recipe sets none.
	cred string
}

// buildStatic builds pkg with CGO_ENABLED=0 and checks the binary is static
// (no program interpreter, no dynamic section), as the Dockerfile's scratch
// image needs.
func buildStatic(t *testing.T, pkg string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "pgrl-recipes-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	bin := filepath.Join(dir, path.Base(pkg))
	cmd := exec.Command("go", "build", "-o", bin, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s with CGO_ENABLED=0: %v\n%s", pkg, err, out)
	}
	if runtime.GOOS == "linux" {
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
				t.Fatalf("%s is not static: it has a %v program header", pkg, p.Type)
			}
		}
	}
	return bin
}

// helpText runs bin --help and returns what it printed.
func helpText(t *testing.T, bin string) string {
	t.Helper()
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("%s --help: %v\n%s", bin, err, out)
	}
	return string(out)
}

var (
	// rl-migrate's help: "  up [N]   apply ..." under "Commands:", and
	// "--name VALUE" or "[--name]" anywhere.
	migrateCommand = regexp.MustCompile(`^  ([a-z]+)\b`)
	longFlag       = regexp.MustCompile(`--([a-z][a-z-]*)(=| [^\s\]-][^\s\]]*|)`)
	// rl-cleanup's help is Go's flag.PrintDefaults: "  -name type".
	goFlag = regexp.MustCompile(`^  -([a-z][a-z-]*)( [a-z]+)?$`)
	// A shell variable assignment before a command: CGO_ENABLED=0 go ...
	assignment = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)
)

// parseMigrateHelp reads rl-migrate's commands and flags from its help. A
// flag takes a value when its first mention is followed by one space and a
// value ("--output text|json", "--partition-width 1h").
func parseMigrateHelp(help string) cliSpec {
	s := cliSpec{name: "rl-migrate", commands: map[string]bool{}, flags: map[string]bool{}}
	inCommands := false
	for _, line := range strings.Split(help, "\n") {
		switch {
		case strings.HasPrefix(line, "Commands:"):
			inCommands = true
			continue
		case line == "" || !strings.HasPrefix(line, " "):
			inCommands = false
		}
		if inCommands {
			if m := migrateCommand.FindStringSubmatch(line); m != nil {
				s.commands[m[1]] = true
			}
		}
		for _, m := range longFlag.FindAllStringSubmatch(line, -1) {
			if _, seen := s.flags[m[1]]; !seen {
				s.flags[m[1]] = m[2] != ""
			}
		}
	}
	return s
}

// parseGoFlagHelp reads a command's flags from Go's flag package usage.
func parseGoFlagHelp(name, help string) cliSpec {
	s := cliSpec{name: name, commands: map[string]bool{}, flags: map[string]bool{"help": false, "h": false}}
	for _, line := range strings.Split(help, "\n") {
		if m := goFlag.FindStringSubmatch(line); m != nil {
			s.flags[m[1]] = m[2] != ""
		}
	}
	return s
}

// check returns what is wrong with one invocation.
func (s cliSpec) check(inv invocation) []string {
	var problems []string
	command := ""
	for i := 0; i < len(inv.args); i++ {
		a := inv.args[i]
		if strings.HasPrefix(a, "-") && a != "-" {
			name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			takes, ok := s.flags[name]
			if !ok {
				problems = append(problems, inv.where+": "+s.name+" has no flag --"+name)
				continue
			}
			if takes && !hasValue {
				i++ // the value
			}
			continue
		}
		switch {
		case len(s.commands) == 0:
			problems = append(problems, inv.where+": "+s.name+" takes no argument "+a)
		case command == "":
			command = a
			if !s.commands[a] {
				problems = append(problems, inv.where+": "+s.name+" has no command "+a)
			}
		}
		// Later words are the command's arguments (up N, layout partitioned).
	}
	if len(s.commands) > 0 && command == "" {
		problems = append(problems, inv.where+": "+s.name+" is called without a command")
	}
	return problems
}

var tools = []string{"rl-migrate", "rl-cleanup"}

// fromArgv returns the invocation if argv calls one of the tools.
func fromArgv(where string, argv []string) (invocation, bool) {
	if len(argv) == 0 {
		return invocation{}, false
	}
	bin := path.Base(argv[0])
	if !slices.Contains(tools, bin) {
		return invocation{}, false
	}
	return invocation{where: where, bin: bin, args: argv[1:]}, true
}

// shellCommands splits a shell command line into commands of words: enough for recipes
// (quotes, no expansions), stopping at ;, &&, || and |, each of which starts
// another command.
func shellCommands(line string) [][]string {
	var (
		cmds [][]string
		cur  []string
		word strings.Builder
		in   rune
		have bool
	)
	flush := func() {
		if have {
			cur = append(cur, word.String())
		}
		word.Reset()
		have = false
	}
	endCmd := func() {
		flush()
		if len(cur) > 0 {
			cmds = append(cmds, cur)
		}
		cur = nil
	}
	for _, r := range line {
		switch {
		case in != 0 && r == in:
			in = 0
		case in != 0:
			word.WriteRune(r)
		case r == '"' || r == '\'':
			in, have = r, true
		case r == ' ' || r == '\t':
			flush()
		case r == ';' || r == '&' || r == '|':
			endCmd()
		default:
			word.WriteRune(r)
			have = true
		}
	}
	endCmd()
	// Drop leading VAR=value assignments of each command.
	for i, c := range cmds {
		for len(c) > 0 && assignment.MatchString(c[0]) {
			c = c[1:]
		}
		cmds[i] = c
	}
	return cmds
}

// yamlInvocations walks any YAML document: a map with "command" (a list)
// and optional "args" is a container; a "run" string is a shell script.
func yamlInvocations(t *testing.T, file string) []invocation {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	var out []invocation
	var walk func(v any, at string)
	walk = func(v any, at string) {
		switch v := v.(type) {
		case map[string]any:
			if cmd, ok := v["command"].([]any); ok {
				var argv []string
				for _, x := range cmd {
					argv = append(argv, toString(x))
				}
				if args, ok := v["args"].([]any); ok {
					for _, x := range args {
						argv = append(argv, toString(x))
					}
				}
				if inv, ok := fromArgv(file+": "+at, argv); ok {
					inv.cred = containerCred(v)
					out = append(out, inv)
				}
			}
			if run, ok := v["run"].(string); ok {
				cred := ""
				if env, ok := v["env"].(map[string]any); ok {
					cred, _ = env["DATABASE_URL"].(string)
				}
				for _, line := range strings.Split(run, "\n") {
					for _, argv := range shellCommands(line) {
						if inv, ok := fromArgv(file+": "+at+": "+strings.TrimSpace(line), argv); ok {
							inv.cred = cred
							out = append(out, inv)
						}
					}
				}
			}
			for k, x := range v {
				walk(x, at+"."+k)
			}
		case []any:
			for _, x := range v {
				walk(x, at)
			}
		}
	}
	walk(doc, "")
	return out
}

// containerCred returns the secret a Kubernetes container reads
// DATABASE_URL from ("secret/key"), or "" when it reads none.
func containerCred(c map[string]any) string {
	env, _ := c["env"].([]any)
	for _, e := range env {
		e, _ := e.(map[string]any)
		if e["name"] != "DATABASE_URL" {
			continue
		}
		vf, _ := e["valueFrom"].(map[string]any)
		ref, _ := vf["secretKeyRef"].(map[string]any)
		if name, _ := ref["name"].(string); name != "" {
			key, _ := ref["key"].(string)
			return "secret " + name + "/" + key
		}
	}
	return ""
}

func toString(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	b, _ := yaml.Marshal(v)
	return strings.TrimSpace(string(b))
}

// iniInvocations reads a systemd unit: every Exec*= line is a command.
func iniInvocations(t *testing.T, file string) []invocation {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []invocation
	cred := ""
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") {
			continue
		}
		key, val, ok := strings.Cut(line, "=")
		if ok && key == "EnvironmentFile" {
			cred = "file " + strings.TrimPrefix(val, "-")
		}
		if !ok || !strings.HasPrefix(key, "Exec") {
			continue
		}
		// systemd prefixes: - @ : + ! mark how the command runs.
		val = strings.TrimLeft(val, "-@:+!")
		for _, argv := range shellCommands(val) {
			if inv, ok := fromArgv(file+":"+strconv.Itoa(n), argv); ok {
				out = append(out, inv)
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	// The unit's environment applies to every command it runs, wherever
	// EnvironmentFile= stands.
	for i := range out {
		out[i].cred = cred
	}
	return out
}

// recipeInvocations returns the invocations of every recipe under dir.
func recipeInvocations(t *testing.T, dir string) []invocation {
	t.Helper()
	var out []invocation
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		switch filepath.Ext(p) {
		case ".yaml", ".yml":
			out = append(out, yamlInvocations(t, p)...)
		case ".service", ".timer":
			out = append(out, iniInvocations(t, p)...)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	helpOnce               sync.Once
	migrateHelp, cleanHelp string
)

// specs builds both tools (static, once per test process) and reads their
// --help.
func specs(t *testing.T) map[string]cliSpec {
	t.Helper()
	helpOnce.Do(func() {
		migrateHelp = helpText(t, buildStatic(t, "github.com/pgrl/pgrl/cmd/rl-migrate"))
		cleanHelp = helpText(t, buildStatic(t, "github.com/pgrl/pgrl/cmd/rl-cleanup"))
	})
	if migrateHelp == "" || cleanHelp == "" {
		t.Fatal("building the commands failed in another test")
	}
	m := parseMigrateHelp(migrateHelp)
	c := parseGoFlagHelp("rl-cleanup", cleanHelp)
	// The parsers must have found something, or every check passes.
	for _, want := range []string{"up", "down", "status", "layout"} {
		if !m.commands[want] {
			t.Fatalf("rl-migrate's help parsed without command %q: %v", want, m.commands)
		}
	}
	if !m.flags["output"] || !m.flags["lock-wait"] || m.flags["check"] {
		t.Fatalf("rl-migrate's flags parsed wrong: %v", m.flags)
	}
	if !c.flags["max-duration"] || !c.flags["output"] || c.flags["dry-run"] {
		t.Fatalf("rl-cleanup's flags parsed wrong: %v", c.flags)
	}
	return map[string]cliSpec{"rl-migrate": m, "rl-cleanup": c}
}

func TestDeployRecipes(t *testing.T) {
	t.Parallel()
	sp := specs(t)
	invs := recipeInvocations(t, "../deploy")
	count := map[string]int{}
	for _, inv := range invs {
		count[inv.bin]++
		for _, p := range sp[inv.bin].check(inv) {
			t.Error(p)
		}
	}
	// Both Kubernetes recipes, the systemd unit and the two Actions lines.
	if count["rl-migrate"] < 3 || count["rl-cleanup"] < 2 {
		t.Fatalf("found too few invocations in deploy/ (%v): is the parser still reading the recipes?", count)
	}

	// The Dockerfile builds both commands from packages that exist, with
	// cgo off, onto an image without libc.
	df, err := os.ReadFile("../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CGO_ENABLED=0 go build", "./cmd/rl-migrate", "./cmd/rl-cleanup", "FROM scratch"} {
		if !strings.Contains(string(df), want) {
			t.Errorf("deploy/Dockerfile lacks %q", want)
		}
	}
	for _, pkg := range []string{"../cmd/rl-migrate", "../cmd/rl-cleanup"} {
		if _, err := os.Stat(pkg); err != nil {
			t.Errorf("deploy/Dockerfile builds %s: %v", pkg, err)
		}
	}
}

// TestDeployRecipeCheckFails is the test of the test: recipes naming a flag
// or command that does not exist must be reported.
func TestDeployRecipeCheckFails(t *testing.T) {
	t.Parallel()
	sp := specs(t)
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("k8s/job.yaml", `
apiVersion: batch/v1
kind: Job
spec:
  template:
    spec:
      containers:
        - name: m
          command: ["/rl-migrate"]
          args: ["--output", "json", "--no-such-flag", "up"]
`)
	write("k8s/cron.yaml", `
kind: CronJob
spec:
  jobTemplate:
    spec:
      template:
        spec:
          containers:
            - command: ["/rl-cleanup", "--max-duraton", "2m"]
`)
	write("systemd/x.service", "[Service]\nExecStart=/usr/local/bin/rl-cleanup --output json extra\n")
	write("gha.yml", "jobs:\n  j:\n    steps:\n      - run: |\n          rl-migrate --output json upp\n          rl-migrate --output json\n")
	var problems []string
	for _, inv := range recipeInvocations(t, dir) {
		problems = append(problems, sp[inv.bin].check(inv)...)
	}
	joined := strings.Join(problems, "\n")
	for _, want := range []string{
		"rl-migrate has no flag --no-such-flag",
		"rl-cleanup has no flag --max-duraton",
		// An unknown flag's value cannot be told from an argument.
		"rl-cleanup takes no argument 2m",
		"rl-cleanup takes no argument extra",
		"rl-migrate has no command upp",
		"rl-migrate is called without a command",
	} {
		if !strings.Contains(joined, want) {
			t.Errorf("the recipe check missed %q; it reported:\n%s", want, joined)
		}
	}
	if len(problems) != 6 {
		t.Errorf("want exactly 6 problems, got %d:\n%s", len(problems), joined)
	}
}

// parsedArgs splits an invocation's arguments by the command's spec into
// its command, its positional arguments and its flags (name -> value, ""
// for a flag without one).
func (s cliSpec) parsedArgs(inv invocation) (command string, pos []string, flags map[string]string) {
	flags = map[string]string{}
	for i := 0; i < len(inv.args); i++ {
		a := inv.args[i]
		if strings.HasPrefix(a, "-") && a != "-" {
			name, val, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			if s.flags[name] && !hasValue && i+1 < len(inv.args) {
				i++
				val = inv.args[i]
			}
			flags[name] = val
			continue
		}
		if command == "" && len(s.commands) > 0 {
			command = a
			continue
		}
		pos = append(pos, a)
	}
	return command, pos, flags
}

// checkRoles returns how the invocations break docs/SECURITY.md: rl-migrate
// runs as the migration role (the owner) with --schema, and up also grants
// the application role (--grant-to); rl-cleanup runs as the cleanup role
// with --schema; each reads its own credentials, from the recipe's secret
// or environment file, never from its arguments.
func checkRoles(sp map[string]cliSpec, invs []invocation) []string {
	var problems []string
	credOf := map[string]map[string]bool{} // credential -> the tools using it
	for _, inv := range invs {
		command, _, flags := sp[inv.bin].parsedArgs(inv)
		if _, ok := flags["help"]; ok {
			continue
		}
		if inv.bin == "rl-migrate" && (command == "version" || command == "sql") {
			continue // no database
		}
		if _, ok := flags["database-url"]; ok {
			problems = append(problems, inv.where+": "+inv.bin+" takes its credentials from --database-url; read DATABASE_URL from a secret")
		}
		if flags["schema"] == "" {
			problems = append(problems, inv.where+": "+inv.bin+" without --schema")
		}
		role := map[string]string{"rl-migrate": "owner", "rl-cleanup": "cleanup"}[inv.bin]
		switch {
		case inv.cred == "":
			problems = append(problems, inv.where+": "+inv.bin+" has no DATABASE_URL of its own (want the "+role+" role's)")
		case !strings.Contains(strings.ToLower(inv.cred), role):
			problems = append(problems, inv.where+": "+inv.bin+" connects with "+inv.cred+", not the "+role+" role's credentials")
		}
		if inv.cred != "" {
			if credOf[inv.cred] == nil {
				credOf[inv.cred] = map[string]bool{}
			}
			credOf[inv.cred][inv.bin] = true
		}
		if inv.bin == "rl-migrate" && command == "up" && flags["grant-to"] == "" {
			problems = append(problems, inv.where+": rl-migrate up without --grant-to (the application role gets no rights)")
		}
	}
	for cred, bins := range credOf {
		if len(bins) > 1 {
			problems = append(problems, "rl-migrate and rl-cleanup share the credentials "+cred)
		}
	}
	slices.Sort(problems)
	return problems
}

func TestDeployRecipeRoles(t *testing.T) {
	t.Parallel()
	sp := specs(t)
	for _, p := range checkRoles(sp, recipeInvocations(t, "../deploy")) {
		t.Error(p)
	}
}

// TestDeployRecipeRoleCheckFails feeds checkRoles the recipes as they were:
// one application secret for everything, no --schema, no --grant-to.
func TestDeployRecipeRoleCheckFails(t *testing.T) {
	t.Parallel()
	sp := specs(t)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "job.yaml"), `
kind: Job
spec:
  template:
    spec:
      containers:
        - command: ["/rl-migrate"]
          args: ["--output", "json", "up"]
          env:
            - name: DATABASE_URL
              valueFrom: {secretKeyRef: {name: app-database, key: url}}
        - command: ["/rl-cleanup", "--output", "json"]
          env:
            - name: DATABASE_URL
              valueFrom: {secretKeyRef: {name: app-database, key: url}}
`)
	writeFile(t, filepath.Join(dir, "x.service"), "[Service]\nExecStart=/usr/local/bin/rl-cleanup --schema s --database-url postgres://u@h/d\n")
	got := strings.Join(checkRoles(sp, recipeInvocations(t, dir)), "\n")
	for _, want := range []string{
		"rl-migrate without --schema",
		"rl-cleanup without --schema",
		"rl-migrate connects with secret app-database/url, not the owner role's",
		"rl-cleanup connects with secret app-database/url, not the cleanup role's",
		"rl-migrate up without --grant-to",
		"rl-migrate and rl-cleanup share the credentials secret app-database/url",
		"rl-cleanup takes its credentials from --database-url",
		"rl-cleanup has no DATABASE_URL of its own",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the role check missed %q; it reported:\n%s", want, got)
		}
	}
}

func writeFile(t *testing.T, name, body string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// yamlDocs returns every document of a YAML file.
func yamlDocs(t *testing.T, file string) []map[string]any {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var docs []map[string]any
	dec := yaml.NewDecoder(f)
	for {
		var d map[string]any
		if err := dec.Decode(&d); err != nil {
			if errors.Is(err, io.EOF) {
				return docs
			}
			t.Fatalf("%s: %v", file, err)
		}
		if d != nil {
			docs = append(docs, d)
		}
	}
}

// dig follows keys through nested maps.
func dig(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// checkJob returns why a Kubernetes Job recipe would not run again on the
// next deploy. A completed Job whose manifest did not change is not re-run
// by `kubectl apply` (and one whose pod template changed is refused), so a
// Job must either have generateName, be made with `kubectl create` and be
// garbage-collected by ttlSecondsAfterFinished, or be a Helm hook that Helm
// deletes before creating it again (before-hook-creation), with a fixed
// name Helm can track, and not be documented for kubectl.
func checkJob(file, text string, job map[string]any) []string {
	var problems []string
	name, _ := dig(job, "metadata", "name").(string)
	gen, _ := dig(job, "metadata", "generateName").(string)
	hook, _ := dig(job, "metadata", "annotations", "helm.sh/hook").(string)
	policy, _ := dig(job, "metadata", "annotations", "helm.sh/hook-delete-policy").(string)
	switch {
	case gen != "" && name == "":
		if dig(job, "spec", "ttlSecondsAfterFinished") == nil {
			problems = append(problems, file+": a Job with generateName needs ttlSecondsAfterFinished, or every deploy leaves one behind")
		}
		if !strings.Contains(text, "kubectl create -f") {
			problems = append(problems, file+": a Job with generateName must be documented with `kubectl create -f` (kubectl apply refuses generateName)")
		}
		if hook != "" {
			problems = append(problems, file+": Helm cannot track a hook with generateName; give the Helm variant a fixed name")
		}
	case name != "" && hook != "":
		if !strings.Contains(hook, "pre-upgrade") || !strings.Contains(policy, "before-hook-creation") {
			problems = append(problems, file+": Job "+name+" is a Helm hook that does not run on every upgrade (want pre-upgrade and hook-delete-policy before-hook-creation)")
		}
		if strings.Contains(text, "kubectl apply -f") || strings.Contains(text, "kubectl create -f") {
			problems = append(problems, file+": Job "+name+" has a fixed name: applied again unchanged after it completed, it does not run; use generateName and `kubectl create` outside Helm")
		}
	default:
		problems = append(problems, file+": Job "+name+" has a fixed name and is no Helm hook: an unchanged completed Job is not re-run on the next deploy; use generateName and `kubectl create`")
	}
	return problems
}

// k8sRecipes returns every Kubernetes document under dir by file.
func k8sRecipes(t *testing.T, dir string) map[string][]map[string]any {
	t.Helper()
	out := map[string][]map[string]any{}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || (filepath.Ext(p) != ".yaml" && filepath.Ext(p) != ".yml") {
			return err
		}
		for _, doc := range yamlDocs(t, p) {
			if _, ok := doc["apiVersion"]; ok {
				out[p] = append(out[p], doc)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDeployMigrationJobReruns(t *testing.T) {
	t.Parallel()
	jobs := 0
	tags := map[string][]string{} // image tag -> where
	for file, docs := range k8sRecipes(t, "../deploy") {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range docs {
			if doc["kind"] == "Job" {
				jobs++
				for _, p := range checkJob(file, string(text), doc) {
					t.Error(p)
				}
			}
			var walk func(v any)
			walk = func(v any) {
				switch v := v.(type) {
				case map[string]any:
					if img, ok := v["image"].(string); ok {
						_, tag, _ := strings.Cut(path.Base(img), ":")
						if tag == "" || tag == "latest" {
							t.Errorf("%s: image %s has no pinned tag; name the pgrl version the application's go.mod requires", file, img)
						}
						tags[tag] = append(tags[tag], file)
					}
					for _, x := range v {
						walk(x)
					}
				case []any:
					for _, x := range v {
						walk(x)
					}
				}
			}
			walk(doc)
		}
	}
	if jobs < 2 {
		t.Fatalf("found %d Jobs in deploy/, want the kubectl Job and the Helm hook", jobs)
	}
	if len(tags) != 1 {
		t.Errorf("the recipes name different image tags: %v", tags)
	}
}

// TestDeployJobCheckFails is the test of checkJob: the Job recipe as it was
// (a fixed name, run with kubectl apply), a fixed-name Job outside Helm, and
// a generateName Job without its TTL are each reported; both shapes of the
// recipes pass.
func TestDeployJobCheckFails(t *testing.T) {
	t.Parallel()
	job := func(meta string, spec string) map[string]any {
		var d map[string]any
		if err := yaml.Unmarshal([]byte("kind: Job\nmetadata:\n"+meta+"spec:\n  backoffLimit: 2\n"+spec), &d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	hookMeta := "  name: pgrl-migrate\n  annotations:\n    helm.sh/hook: pre-install,pre-upgrade\n    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded\n"
	cases := []struct {
		name, text string
		job        map[string]any
		want       string
	}{
		{"old recipe", "#   kubectl apply -f migrate-job.yaml && kubectl wait --for=condition=complete job/pgrl-migrate",
			job(hookMeta, ""), "has a fixed name: applied again unchanged"},
		{"fixed name", "", job("  name: pgrl-migrate\n", ""), "is no Helm hook"},
		{"hook without recreation", "", job("  name: m\n  annotations:\n    helm.sh/hook: pre-install\n", ""), "does not run on every upgrade"},
		{"no ttl", "kubectl create -f job.yaml", job("  generateName: m-\n", ""), "needs ttlSecondsAfterFinished"},
		{"applied", "kubectl apply -f job.yaml", job("  generateName: m-\n", "  ttlSecondsAfterFinished: 60\n"), "documented with `kubectl create -f`"},
		{"generateName", "kubectl create -f job.yaml", job("  generateName: m-\n", "  ttlSecondsAfterFinished: 60\n"), ""},
		{"helm hook", "", job(hookMeta, ""), ""},
	}
	for _, c := range cases {
		got := strings.Join(checkJob(c.name, c.text, c.job), "\n")
		switch {
		case c.want == "" && got != "":
			t.Errorf("%s: want no problem, got %s", c.name, got)
		case c.want != "" && !strings.Contains(got, c.want):
			t.Errorf("%s: want %q, got %q", c.name, c.want, got)
		}
	}
}

// goInstallVersion matches `go install github.com/pgrl/pgrl/...@VERSION`.
var goInstallVersion = regexp.MustCompile(`go install\s+"?github\.com/pgrl/pgrl/[^\s@"]+(@[^\s"]*)?`)

// checkActions returns why a workflow's installs of pgrl's commands do not
// follow the application's go.mod, and the shell line that computes the
// version, if any.
func checkActions(file string, doc map[string]any) (problems []string, versionLine string) {
	installs := 0
	for jobName, job := range doc["jobs"].(map[string]any) {
		checkedOut, goMod := false, false
		steps, _ := dig(job, "steps").([]any)
		for _, st := range steps {
			uses, _ := dig(st, "uses").(string)
			if strings.HasPrefix(uses, "actions/checkout@") {
				checkedOut = true
			}
			if strings.HasPrefix(uses, "actions/setup-go@") && dig(st, "with", "go-version-file") == "go.mod" {
				goMod = true
			}
			run, _ := dig(st, "run").(string)
			for _, m := range goInstallVersion.FindAllStringSubmatch(run, -1) {
				installs++
				where := file + ": job " + jobName + ": " + m[0]
				if !checkedOut {
					problems = append(problems, where+": runs before actions/checkout, so there is no go.mod to take the version from")
				}
				if !goMod {
					problems = append(problems, where+": setup-go does not take the Go version from go.mod (go-version-file: go.mod)")
				}
				v := strings.TrimPrefix(m[1], "@")
				switch {
				case v == "":
					// Inside the module: go.mod resolves the version.
				case strings.HasPrefix(v, "$"):
					name := strings.Trim(strings.TrimPrefix(v, "$"), "{}")
					found := false
					for _, line := range strings.Split(run, "\n") {
						line = strings.TrimSpace(line)
						if strings.HasPrefix(line, name+"=") && strings.Contains(line, "go list -m") && strings.Contains(line, "github.com/pgrl/pgrl") {
							found, versionLine = true, line
						}
					}
					if !found {
						problems = append(problems, where+": $"+name+" is not set from `go list -m ... github.com/pgrl/pgrl` in the same step")
					}
				default:
					problems = append(problems, where+": installs "+v+", not the version the application's go.mod requires")
				}
			}
		}
	}
	if installs == 0 {
		problems = append(problems, file+": installs no pgrl command")
	}
	return problems, versionLine
}

func TestDeployActionsPinned(t *testing.T) {
	t.Parallel()
	file := "../deploy/github-actions.yml"
	docs := yamlDocs(t, file)
	problems, line := checkActions(file, docs[0])
	for _, p := range problems {
		t.Error(p)
	}
	if line == "" {
		t.Fatal("found no line computing the version")
	}
	// Run that line in an application module requiring pgrl (replaced by
	// this checkout, so nothing is downloaded): it must print the required
	// version.
	app := t.TempDir()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(app, "go.mod"), "module example.com/app\n\ngo 1.26\n\nrequire github.com/pgrl/pgrl v0.42.1\n\nreplace github.com/pgrl/pgrl => "+root+"\n")
	name, _, _ := strings.Cut(line, "=")
	cmd := exec.Command("bash", "-c", "set -euo pipefail; "+line+"; printf %s \"$"+name+"\"")
	cmd.Dir = app
	cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=")
	out, err := cmd.CombinedOutput()
	if err != nil || string(out) != "v0.42.1" {
		t.Errorf("%q in a module requiring pgrl v0.42.1: %v, printed %q", line, err, out)
	}
}

// TestDeployActionsCheckFails: the workflow as it was (@latest, no checkout)
// is reported.
func TestDeployActionsCheckFails(t *testing.T) {
	t.Parallel()
	var doc map[string]any
	err := yaml.Unmarshal([]byte(`
jobs:
  migrate:
    steps:
      - uses: actions/setup-go@v5
        with: {go-version: "1.26"}
      - run: CGO_ENABLED=0 go install github.com/pgrl/pgrl/cmd/rl-migrate@latest
      - uses: actions/checkout@v4
      - run: go install github.com/pgrl/pgrl/cmd/rl-migrate@$v
`), &doc)
	if err != nil {
		t.Fatal(err)
	}
	problems, _ := checkActions("gha.yml", doc)
	got := strings.Join(problems, "\n")
	for _, want := range []string{
		"installs latest, not the version",
		"runs before actions/checkout",
		"does not take the Go version from go.mod",
		"$v is not set from `go list -m",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the Actions check missed %q; it reported:\n%s", want, got)
		}
	}
}

// imageCommands are the commands deploy/Dockerfile ships.
var imageCommands = []string{"rl-migrate", "rl-cleanup", "rl-policy"}

// TestDeployImage checks the container recipe: every command is built
// static and copied into the scratch image, and the build's ldflags make
// the commands with a version command report the release given as VERSION
// (the build context has no .git, so the build information has none).
func TestDeployImage(t *testing.T) {
	t.Parallel()
	df, err := os.ReadFile("../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	text := string(df)
	if !regexp.MustCompile(`(?m)^ARG VERSION`).MatchString(text) {
		t.Error("deploy/Dockerfile has no ARG VERSION")
	}
	var copied []string
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "COPY --from=build /out/") {
			copied = append(copied, strings.Fields(line)[2:]...)
		}
	}
	builds := regexp.MustCompile(`CGO_ENABLED=0 go build (-trimpath )?-ldflags="([^"]*)" -o /out/(\S+) \./cmd/(\S+)`).FindAllStringSubmatch(text, -1)
	built := map[string]string{} // command -> ldflags
	for _, b := range builds {
		if b[3] != b[4] {
			t.Errorf("deploy/Dockerfile builds ./cmd/%s into /out/%s", b[4], b[3])
		}
		built[b[3]] = b[2]
	}
	for _, c := range imageCommands {
		if _, ok := built[c]; !ok {
			t.Errorf("deploy/Dockerfile does not build %s with CGO_ENABLED=0", c)
		}
		if !slices.Contains(copied, "/out/"+c) {
			t.Errorf("deploy/Dockerfile does not copy %s into the image (COPY --from=build lists %v)", c, copied)
		}
		if !strings.Contains(built[c], "-X main.version=${VERSION}") {
			t.Errorf("deploy/Dockerfile builds %s without -X main.version=${VERSION}", c)
		}
	}
	// What a version command prints from such a build.
	const release = "v0.42.1-image-test"
	for _, c := range []string{"rl-migrate", "rl-policy"} {
		flags := strings.ReplaceAll(built[c], "${VERSION}", release)
		bin := filepath.Join(t.TempDir(), c)
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags="+flags, "-o", bin, "../cmd/"+c)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build %s as the Dockerfile does: %v\n%s", c, err, out)
		}
		out, err := exec.Command(bin, "version").CombinedOutput()
		if err != nil || !strings.Contains(string(out), release) {
			t.Errorf("%s version from the Dockerfile's build: %v, printed %q, want %s", c, err, out, release)
		}
	}
}

// TestDeployDockerignore: the build context (COPY . .) leaves out Git's
// history and the local PostgreSQL data and binaries.
func TestDeployDockerignore(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../.dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	excluded := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		// Docker cleans each pattern (filepath.Clean) and matches it from
		// the context's root; a leading ! re-includes.
		p := strings.TrimPrefix(filepath.Clean(strings.TrimPrefix(line, "!")), "/")
		excluded[p] = !strings.HasPrefix(line, "!")
	}
	for _, want := range []string{".git", ".pgdata", ".pgcache"} {
		if !excluded[want] {
			t.Errorf(".dockerignore does not exclude %s", want)
		}
	}
}

// systemdHardening are the directives the rl-cleanup unit must set, with
// their values; a value "" must be set empty.
var systemdHardening = map[string]string{
	"DynamicUser":             "yes",
	"NoNewPrivileges":         "yes",
	"CapabilityBoundingSet":   "",
	"ProtectSystem":           "strict",
	"ProtectHome":             "yes",
	"PrivateTmp":              "yes",
	"PrivateDevices":          "yes",
	"ProtectKernelTunables":   "yes",
	"ProtectKernelModules":    "yes",
	"ProtectControlGroups":    "yes",
	"RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
	"RestrictNamespaces":      "yes",
	"RestrictSUIDSGID":        "yes",
	"LockPersonality":         "yes",
	"MemoryDenyWriteExecute":  "yes",
	"SystemCallArchitectures": "native",
	"SystemCallFilter":        "@system-service",
}

// unitDirectives returns a unit's key=value lines; a key given several
// times keeps every value.
func unitDirectives(text string) map[string][]string {
	out := map[string][]string{}
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") || strings.HasPrefix(line, "[") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if ok {
			out[k] = append(out[k], v)
		}
	}
	return out
}

// checkHardening returns the hardening directives a unit lacks.
func checkHardening(text string) []string {
	d := unitDirectives(text)
	var problems []string
	for k, want := range systemdHardening {
		if !slices.Contains(d[k], want) {
			problems = append(problems, fmt.Sprintf("%s=%s missing (has %q)", k, want, d[k]))
		}
	}
	slices.Sort(problems)
	return problems
}

// exposure runs systemd-analyze security --offline on a unit file and
// returns its overall exposure (0 safe to 10 exposed).
func exposure(t *testing.T, analyze, unit string) float64 {
	t.Helper()
	out, _ := exec.Command(analyze, "security", "--offline=yes", "--no-pager", unit).CombinedOutput()
	m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("systemd-analyze security %s printed no exposure level:\n%s", unit, out)
	}
	f, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// maxExposure is the highest exposure systemd-analyze security may rate the
// unit (1.1 with systemd 252; "OK" goes up to 3.9).
const maxExposure = 2.0

func TestDeploySystemdHardened(t *testing.T) {
	t.Parallel()
	unit := "../deploy/systemd/rl-cleanup.service"
	data, err := os.ReadFile(unit)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range checkHardening(string(data)) {
		t.Error("deploy/systemd/rl-cleanup.service: " + p)
	}
	// The test of the check: a bare unit lacks every directive.
	if n := len(checkHardening("[Service]\nExecStart=/usr/local/bin/rl-cleanup\n")); n != len(systemdHardening) {
		t.Errorf("a bare unit lacks %d of the %d directives, by the check", n, len(systemdHardening))
	}

	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("no systemd-analyze here: checked the directives only")
		return
	}
	dir := t.TempDir()
	// systemd-analyze reads a unit by its file name.
	bare := filepath.Join(dir, "bare.service")
	writeFile(t, bare, "[Service]\nType=oneshot\nExecStart=/bin/true\n")
	if e := exposure(t, analyze, bare); e <= maxExposure {
		t.Fatalf("a bare unit rates %.1f, not above %.1f: the exposure check cannot fail", e, maxExposure)
	}
	if e := exposure(t, analyze, unit); e > maxExposure {
		t.Errorf("systemd-analyze security rates deploy/systemd/rl-cleanup.service %.1f, want at most %.1f", e, maxExposure)
	} else {
		t.Logf("systemd-analyze security: rl-cleanup.service rates %.1f", e)
	}
	// systemd-analyze verify warns about a misspelt or unknown directive
	// (and exits 0): it must print nothing. It needs the program to exist
	// and the environment file to be optional.
	bin := buildStatic(t, "github.com/pgrl/pgrl/cmd/rl-cleanup")
	text := strings.ReplaceAll(string(data), "/usr/local/bin/rl-cleanup", bin)
	text = strings.ReplaceAll(text, "EnvironmentFile=/", "EnvironmentFile=-/")
	copyUnit := filepath.Join(dir, "rl-cleanup.service")
	writeFile(t, copyUnit, text)
	out, err := exec.Command(analyze, "verify", copyUnit).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "" {
		t.Errorf("systemd-analyze verify deploy/systemd/rl-cleanup.service: %v\n%s", err, out)
	}
}

// TestDeployDocShowsRecipes: docs/DEPLOY.md reproduces every recipe as it
// is in deploy/.
func TestDeployDocShowsRecipes(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/DEPLOY.md")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	err = filepath.WalkDir("../deploy", func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		n++
		body, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if !strings.Contains(string(doc), strings.TrimSpace(string(body))) {
			t.Errorf("docs/DEPLOY.md does not show %s as it is", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 6 {
		t.Fatalf("found %d recipes in deploy/", n)
	}
}

// TestDeployRecipesRunAsRoles runs every database call of the recipes, with
// their arguments, against the test database under the roles they name: the
// migration calls as a role owning the schema, the cleanup calls as a role
// given exactly the grants docs/DEPLOY.md lists. The recipes' schema
// "ratelimit" and application role "app" become fresh ones. A recipe that
// needs a right the docs do not give fails here.
func TestDeployRecipesRunAsRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, owner, app, cleaner := dbtest.NewSchema(t), dbtest.NewRole(t), dbtest.NewRole(t), dbtest.NewRole(t)
	admin := dbtest.Admin(t)
	if _, err := admin.Exec(ctx, "ALTER SCHEMA "+pgx.Identifier{schema}.Sanitize()+" OWNER TO "+pgx.Identifier{owner}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	bins := map[string]string{
		"rl-migrate": buildStatic(t, "github.com/pgrl/pgrl/cmd/rl-migrate"),
		"rl-cleanup": buildStatic(t, "github.com/pgrl/pgrl/cmd/rl-cleanup"),
	}
	// The cleanup role's grants, as docs/DEPLOY.md gives them.
	doc, err := os.ReadFile("../docs/DEPLOY.md")
	if err != nil {
		t.Fatal(err)
	}
	grants := regexp.MustCompile("(?s)```sql\n(GRANT USAGE ON SCHEMA ratelimit TO pgrl_cleanup;.*?)```").FindSubmatch(doc)
	if grants == nil {
		t.Fatal("docs/DEPLOY.md shows no GRANT for pgrl_cleanup")
	}
	sql := strings.NewReplacer("ratelimit.", pgx.Identifier{schema}.Sanitize()+".", "SCHEMA ratelimit", "SCHEMA "+pgx.Identifier{schema}.Sanitize(),
		"pgrl_cleanup;", pgx.Identifier{cleaner}.Sanitize()+";").Replace(string(grants[1]))

	var migrations, cleanups []invocation
	for _, inv := range recipeInvocations(t, "../deploy") {
		if inv.bin == "rl-migrate" {
			migrations = append(migrations, inv)
		} else {
			cleanups = append(cleanups, inv)
		}
	}
	run := func(inv invocation, role string) {
		t.Helper()
		args := slices.Clone(inv.args)
		for i := 1; i < len(args); i++ {
			switch {
			case args[i-1] == "--schema" && args[i] == "ratelimit":
				args[i] = schema
			case args[i-1] == "--grant-to" && args[i] == "app":
				args[i] = app
			}
		}
		cmd := exec.Command(bins[inv.bin], args...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+dbtest.URLAs(role))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("%s: %s %s as the %s role: %v\n%s", inv.where, inv.bin, strings.Join(args, " "), map[string]string{owner: "migration", cleaner: "cleanup"}[role], err, out)
		}
	}
	// Twice, as two deploys would.
	for range 2 {
		for _, inv := range migrations {
			run(inv, owner)
		}
	}
	var appRights bool
	if err := admin.QueryRow(ctx, "SELECT has_table_privilege($1, $2, 'INSERT, UPDATE')", app, schema+".pgrl_fixed_window").Scan(&appRights); err != nil || !appRights {
		t.Errorf("after the recipes' rl-migrate up, the application role cannot write the counters (%v)", err)
	}
	for _, stmt := range strings.Split(sql, ";") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatalf("docs/DEPLOY.md's grant %q: %v", strings.TrimSpace(stmt), err)
		}
	}
	for _, inv := range cleanups {
		run(inv, cleaner)
	}
	if len(migrations) < 4 || len(cleanups) < 2 {
		t.Fatalf("ran %d migration and %d cleanup calls", len(migrations), len(cleanups))
	}
}
