package tests

import (
	"os/exec"
	"path"
	"path/filepath"
	"testing"
)

// buildCommand compiles the main package pkg into the test's temporary
// directory and returns the binary's path. (The demo spawns copies of
// itself, one per process, and releases them together through a start
// barrier; the example app runs as several processes sharing one schema.)
func buildCommand(t *testing.T, pkg string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), path.Base(pkg))
	out, err := exec.Command("go", "build", "-o", bin, pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, out)
	}
	return bin
}
