package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/pgrl/pgrl/cleanup"
)

// progress turns cleanup's progress callbacks into lines on stderr.
//
// When stderr is a terminal, it keeps one status line up to date in place
// (at most ten redraws a second): the table, rows deleted or partitions
// dropped so far, and the rate. Elsewhere (cron, a log file, a pipe) it
// writes one plain line per --progress-every interval, as a log wants.
type progress struct {
	w     io.Writer
	tty   bool
	every time.Duration

	last       time.Time     // last line written
	table      string        // table of the previous report
	tableStart time.Duration // run time when that table's work began
	seen       time.Duration // run time of the previous report
	shown      int           // width of the status line on screen
}

// ttyRedraw is how often the terminal status line is redrawn at most.
const ttyRedraw = 100 * time.Millisecond

// newProgress returns a reporter writing to w; tty says whether w is a
// terminal (see isTerminal), every is the interval between plain lines.
func newProgress(w io.Writer, tty bool, every time.Duration) *progress {
	return &progress{w: w, tty: tty, every: every, last: time.Now()}
}

// report is the cleanup.Options.Progress callback.
func (p *progress) report(pr cleanup.Progress) {
	if pr.Table != p.table {
		// The previous table's work ended at the previous report.
		p.table, p.tableStart = pr.Table, p.seen
	}
	p.seen = pr.Elapsed
	interval := p.every
	if p.tty {
		interval = ttyRedraw
	}
	if time.Since(p.last) < interval {
		return
	}
	p.last = time.Now()
	if !p.tty {
		if pr.PartitionsDropped > 0 && pr.Table == cleanup.TableFixedWindow {
			fmt.Fprintf(p.w, "rl-cleanup: %s: %d partitions dropped (%s)\n", pr.Table, pr.PartitionsDropped, pr.Elapsed.Round(time.Millisecond))
			return
		}
		fmt.Fprintf(p.w, "rl-cleanup: %s: %d rows deleted in %d batches (%s)\n", pr.Table, pr.Deleted, pr.Batches, pr.Elapsed.Round(time.Millisecond))
		return
	}
	p.draw(statusLine(pr, pr.Elapsed-p.tableStart))
}

// statusLine is the terminal's one-line summary; onTable is the time spent
// on the current table, which the rate is taken over.
func statusLine(pr cleanup.Progress, onTable time.Duration) string {
	secs := onTable.Seconds()
	if pr.PartitionsDropped > 0 && pr.Table == cleanup.TableFixedWindow {
		return fmt.Sprintf("rl-cleanup: %s: %d partitions dropped, %s/s (%s)",
			pr.Table, pr.PartitionsDropped, rate(float64(pr.PartitionsDropped), secs), pr.Elapsed.Round(100*time.Millisecond))
	}
	return fmt.Sprintf("rl-cleanup: %s: %d rows deleted in %d batches, %s rows/s (%s)",
		pr.Table, pr.Deleted, pr.Batches, rate(float64(pr.Deleted), secs), pr.Elapsed.Round(100*time.Millisecond))
}

func rate(n, secs float64) string {
	if secs <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", n/secs)
}

// draw rewrites the status line in place, blanking what a longer previous
// line left behind.
func (p *progress) draw(line string) {
	pad := ""
	if n := p.shown - len(line); n > 0 {
		pad = strings.Repeat(" ", n)
	}
	fmt.Fprintf(p.w, "\r%s%s", line, pad)
	p.shown = len(line)
}

// finish ends the status line, so that what follows starts on a line of
// its own. Call it once the run has returned.
func (p *progress) finish() {
	if p.tty && p.shown > 0 {
		fmt.Fprintln(p.w)
		p.shown = 0
	}
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && fileIsTerminal(f)
}
