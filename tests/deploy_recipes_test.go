package tests

import (
	"bufio"
	"debug/elf"
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

	"go.yaml.in/yaml/v3"
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
					out = append(out, inv)
				}
			}
			if run, ok := v["run"].(string); ok {
				for _, line := range strings.Split(run, "\n") {
					for _, argv := range shellCommands(line) {
						if inv, ok := fromArgv(file+": "+at+": "+strings.TrimSpace(line), argv); ok {
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
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || strings.HasPrefix(line, ";") {
			continue
		}
		key, val, ok := strings.Cut(line, "=")
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
