package main

import (
	"bytes"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/pgrl/pgrl/cleanup"
)

// In cron (not a terminal) the reporter writes one plain line per
// interval, as before the terminal status line existed.
func TestProgressPlainLinesPerInterval(t *testing.T) {
	var buf bytes.Buffer
	p := newProgress(&buf, false, time.Hour)
	p.last = time.Now().Add(-2 * time.Hour)
	p.report(cleanup.Progress{Table: cleanup.TableFixedWindow, Deleted: 5000, Batches: 1, Elapsed: 1500 * time.Millisecond})
	p.report(cleanup.Progress{Table: cleanup.TableFixedWindow, Deleted: 10000, Batches: 2, Elapsed: 2 * time.Second})
	p.finish()
	want := "rl-cleanup: pgrl_fixed_window: 5000 rows deleted in 1 batches (1.5s)\n"
	if buf.String() != want {
		t.Fatalf("got %q, want %q", buf.String(), want)
	}
	buf.Reset()
	p.last = time.Now().Add(-2 * time.Hour)
	p.report(cleanup.Progress{Table: cleanup.TableFixedWindow, PartitionsDropped: 3, Elapsed: time.Second})
	if want := "rl-cleanup: pgrl_fixed_window: 3 partitions dropped (1s)\n"; buf.String() != want {
		t.Fatalf("got %q, want %q", buf.String(), want)
	}
}

// On a terminal the reporter redraws one status line in place, with the
// rate over the current table, and ends it with a newline when done.
func TestProgressTerminalStatusLine(t *testing.T) {
	var buf bytes.Buffer
	p := newProgress(&buf, true, time.Hour)
	p.last = time.Time{}
	// The first table took 2s from the start; the second's rate is taken
	// from there.
	p.report(cleanup.Progress{Table: cleanup.TableFixedWindow, Deleted: 40000, Batches: 8, Elapsed: 2 * time.Second})
	p.last = time.Time{}
	p.report(cleanup.Progress{Table: cleanup.TableTokenBucket, Deleted: 0, Batches: 0, Elapsed: 2 * time.Second})
	p.last = time.Time{}
	p.report(cleanup.Progress{Table: cleanup.TableTokenBucket, Deleted: 3000, Batches: 1, Elapsed: 3 * time.Second})
	p.finish()
	out := buf.String()
	frames := strings.Split(strings.TrimSuffix(out, "\n"), "\r")[1:]
	if len(frames) != 3 || !strings.HasSuffix(out, "\n") || strings.Count(out, "\n") != 1 {
		t.Fatalf("want three frames on one line ended by a newline, got %q", out)
	}
	if !strings.Contains(frames[0], "pgrl_fixed_window: 40000 rows deleted in 8 batches, 20000 rows/s (2s)") {
		t.Fatalf("frame 0: %q", frames[0])
	}
	if !strings.Contains(frames[2], "pgrl_token_bucket: 3000 rows deleted in 1 batches, 3000 rows/s (3s)") {
		t.Fatalf("frame 2: %q", frames[2])
	}
	// A shorter frame blanks what the longer one before it left.
	if len(frames[1]) < len(frames[0]) {
		t.Fatalf("frame 1 (%d) is shorter than frame 0 (%d): leftovers on screen", len(frames[1]), len(frames[0]))
	}
	// Redraws are throttled.
	buf.Reset()
	p.last = time.Now()
	p.report(cleanup.Progress{Table: cleanup.TableTokenBucket, Deleted: 4000, Batches: 2, Elapsed: 3 * time.Second})
	if buf.Len() != 0 {
		t.Fatalf("redrawn within %v: %q", ttyRedraw, buf.String())
	}
}

func TestIsTerminal(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	for name, wr := range map[string]any{"pipe": w, "buffer": &bytes.Buffer{}} {
		if isTerminal(wr.(interface{ Write([]byte) (int, error) })) {
			t.Errorf("%s taken for a terminal", name)
		}
	}
	if fileIsTerminal(devNull) && runtime.GOOS == "linux" {
		t.Error("/dev/null taken for a terminal")
	}
	// A pseudo-terminal is one.
	ptm, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no pseudo-terminal here: %v", err)
	}
	defer ptm.Close()
	if !isTerminal(ptm) {
		t.Error("a pseudo-terminal is not taken for a terminal")
	}
}
