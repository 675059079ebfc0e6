// Package golden compares a test's output with a file checked in under the
// package's testdata directory, so that a change to an output format shows
// as a failing test. Run the test with -update to rewrite the files, then
// review the diff.
package golden

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata instead of comparing with them")

// Check fails t when got differs from testdata/name; with -update it writes
// got there first.
func Check(t testing.TB, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v: run go test -run '%s' -update to write it", err, t.Name())
	}
	if !bytes.Equal(got, want) {
		t.Errorf("output differs from %s (if the change is meant, run go test -run '%s' -update):\n--- got\n%s\n--- want\n%s", path, t.Name(), got, want)
	}
}
