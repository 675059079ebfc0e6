package tests

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The scripts that start servers (bench/test.sh's Redis, scripts/pg.sh's
// PostgreSQL, scripts/matrix.sh through it) stop them with the helpers of
// scripts/lib.sh, which wait until a process is gone before its files are
// removed, and never let cleanup change a script's exit status. These tests
// run the helpers in bash against processes that keep writing into their
// directory while they shut down, as Redis does.

// runLib runs a bash script that has sourced scripts/lib.sh and returns its
// output and exit code.
func runLib(t *testing.T, script string) (string, int) {
	t.Helper()
	lib, err := filepath.Abs("../scripts/lib.sh")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", "-c", "set -euo pipefail\n. "+lib+"\n"+script)
	// mktemp makes its directories in the test's own, which the test
	// removes even when a script failed half-way.
	cmd.Env = append(os.Environ(), "TMPDIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("bash: %v\n%s", err, out)
	}
	return string(out), code
}

// slowServer starts, detached like a daemon (its parent exits), a process
// that, sent SIGTERM, keeps writing into $dir for about a second before it
// writes $dir/bye and exits; its pid is in $dir/pid. With ignoreTerm it
// ignores SIGTERM instead.
const slowServer = `
start_slow_server() {
	local on_term='for i in $(seq 10); do echo "$i" >"$dir/late.$i"; sleep 0.1; done; echo bye >"$dir/bye"; exit 0'
	[[ ${1:-} != ignore-term ]] || on_term=''
	( (trap "$on_term" TERM; echo "$BASHPID" >"$dir/pid"; while :; do echo x >>"$dir/server.log"; sleep 0.05; done) </dev/null >/dev/null 2>&1 & )
	for _ in $(seq 100); do [[ -s $dir/pid ]] && return 0; sleep 0.05; done
	echo "the server did not start"; exit 9
}
dir=$(mktemp -d)
`

func TestScriptStopWaitsForServer(t *testing.T) {
	t.Parallel()
	// The test of the test: a bare kill returns while the server is still
	// running and writing into its directory, which is what made
	// bench/test.sh's rm -rf fail with "Directory not empty".
	out, code := runLib(t, slowServer+`
start_slow_server
pid=$(cat "$dir/pid")
kill "$pid"
sleep 0.3
if pgrl_alive "$pid"; then echo "alive after kill"; fi
pgrl_stop_pid "$pid"
rm -rf "$dir"
`)
	if code != 0 || !strings.Contains(out, "alive after kill") {
		t.Fatalf("the slow server should outlive a bare kill (exit %d):\n%s", code, out)
	}

	start := time.Now()
	out, code = runLib(t, slowServer+`
start_slow_server
pid=$(cat "$dir/pid")
pgrl_stop_pidfile "$dir/pid"
if pgrl_alive "$pid"; then echo "STILL ALIVE"; fi
# The server finished its shutdown before the helper returned.
[[ -f $dir/bye ]] && echo "shutdown complete"
pgrl_remove_dir "$dir"
[[ -e $dir ]] && echo "DIR LEFT"
echo done
`)
	if code != 0 || strings.Contains(out, "STILL ALIVE") || strings.Contains(out, "DIR LEFT") ||
		!strings.Contains(out, "shutdown complete") || !strings.Contains(out, "done") {
		t.Fatalf("pgrl_stop_pidfile did not wait for the server's shutdown (exit %d):\n%s", code, out)
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("stopping took %v, less than the server's one-second shutdown", d)
	}
}

func TestScriptStopKillsAfterBound(t *testing.T) {
	t.Parallel()
	start := time.Now()
	out, code := runLib(t, slowServer+`
start_slow_server ignore-term
pid=$(cat "$dir/pid")
pgrl_stop_pid "$pid" 1
if pgrl_alive "$pid"; then echo "STILL ALIVE"; fi
pgrl_remove_dir "$dir"
echo done
`)
	if code != 0 || strings.Contains(out, "STILL ALIVE") || !strings.Contains(out, "sending SIGKILL") || !strings.Contains(out, "done") {
		t.Fatalf("pgrl_stop_pid did not kill a server that ignores SIGTERM (exit %d):\n%s", code, out)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("stopping a server that ignores SIGTERM took %v with a 1 s bound", d)
	}
	// Nothing to stop is no error.
	if out, code := runLib(t, "pgrl_stop_pid 999999999; pgrl_stop_pidfile /nonexistent/pid; echo ok"); code != 0 || !strings.Contains(out, "ok") {
		t.Errorf("stopping nothing: exit %d:\n%s", code, out)
	}
}

func TestScriptCleanupKeepsExitStatus(t *testing.T) {
	t.Parallel()
	// Cleanup that fails: rm cannot remove the directory, and the last
	// command fails, under set -e.
	const failing = `
dir=$(mktemp -d)
cleanup() {
	rm() { echo "rm: cannot remove '$dir': Directory not empty" >&2; return 1; }
	pgrl_remove_dir "$dir" 1
	unset -f rm
	command rm -rf "$dir"
	false
}
`
	// The test of the test: a plain EXIT trap turns a passing run into a
	// failing one.
	if _, code := runLib(t, failing+"trap cleanup EXIT\nexit 0\n"); code == 0 {
		t.Fatal("a plain EXIT trap whose last command fails kept exit 0 under set -e: the check below proves nothing")
	}
	for _, want := range []int{0, 3} {
		out, code := runLib(t, failing+"trap 'pgrl_exit_trap cleanup' EXIT\nexit "+strconv.Itoa(want)+"\n")
		if code != want {
			t.Errorf("exit %d with pgrl_exit_trap and a failing cleanup: got exit %d:\n%s", want, code, out)
		}
		if !strings.Contains(out, "warning: could not remove") {
			t.Errorf("pgrl_remove_dir did not log the directory it could not remove:\n%s", out)
		}
	}
}

// TestScriptsUseStopHelpers: no script but scripts/lib.sh signals a
// process itself (a bare kill does not wait), and every EXIT trap either
// goes through pgrl_exit_trap or cannot fail.
func TestScriptsUseStopHelpers(t *testing.T) {
	t.Parallel()
	var files []string
	for _, pattern := range []string{"../scripts/*.sh", "../bench/*.sh", "../ulule/*.sh", "../.ci/run"} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) < 8 {
		t.Fatalf("found only %d scripts: %v", len(files), files)
	}
	kill := regexp.MustCompile(`(^|[\s;&|(])kill\s`)
	exitTrap := regexp.MustCompile(`^\s*trap\s+(.*)\s+EXIT\s*$`)
	for _, f := range files {
		if filepath.Base(f) == "lib.sh" {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(data), "\n") {
			code, _, _ := strings.Cut(line, " #")
			if strings.HasPrefix(strings.TrimSpace(code), "#") {
				continue
			}
			if kill.MatchString(code) {
				t.Errorf("%s:%d: signals a process itself; use pgrl_stop_pid or pgrl_stop_pidfile, which wait until it is gone: %s", f, n+1, strings.TrimSpace(line))
			}
			if m := exitTrap.FindStringSubmatch(code); m != nil && !strings.Contains(m[1], "pgrl_exit_trap") && !strings.HasSuffix(strings.Trim(m[1], `'"`), "|| true") {
				t.Errorf("%s:%d: an EXIT trap that can change the exit status; use trap 'pgrl_exit_trap CMD' EXIT: %s", f, n+1, strings.TrimSpace(line))
			}
		}
	}
}
