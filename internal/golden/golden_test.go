package golden

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that notes failures instead of stopping.
type recorder struct {
	testing.TB
	failed []string
}

func (r *recorder) Helper()                        {}
func (r *recorder) Name() string                   { return "TestX" }
func (r *recorder) Errorf(format string, a ...any) { r.failed = append(r.failed, format) }
func (r *recorder) Fatalf(format string, a ...any) { r.failed = append(r.failed, format) }
func (r *recorder) Fatal(a ...any)                 { r.failed = append(r.failed, "fatal") }

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	if err := os.Mkdir("testdata", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join("testdata", "out.txt"), []byte("same\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := &recorder{TB: t}
	Check(r, "out.txt", []byte("same\n"))
	if len(r.failed) != 0 {
		t.Errorf("equal output failed: %v", r.failed)
	}
	Check(r, "out.txt", []byte("other\n"))
	if len(r.failed) != 1 || !strings.Contains(r.failed[0], "differs") {
		t.Errorf("different output: %v", r.failed)
	}
	r.failed = nil
	Check(r, "missing.txt", nil)
	if len(r.failed) != 1 || !strings.Contains(r.failed[0], "-update") {
		t.Errorf("missing file: %v", r.failed)
	}
}
