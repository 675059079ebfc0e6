package ratelimit

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestDeadlinesEndAtTheDeadline: a context bounded by deadlines ends once
// its deadline has passed, within a tick (and a busy machine's delay), with
// context.DeadlineExceeded, as context.WithTimeout's would; contexts made
// from it end with it.
func TestDeadlinesEndAtTheDeadline(t *testing.T) {
	d := newDeadlines(160 * time.Millisecond) // a 10 ms tick
	start := time.Now()
	ctx, cancel := d.within(context.Background(), 100*time.Millisecond)
	defer cancel()
	child, cancelChild := context.WithCancel(ctx)
	defer cancelChild()
	if dl, ok := ctx.Deadline(); !ok || dl.Before(start.Add(100*time.Millisecond)) {
		t.Fatalf("Deadline() = %v, %v; want at least 100ms from the start", dl, ok)
	}
	if err := ctx.Err(); err != nil {
		t.Fatalf("Err() before the deadline = %v", err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the context did not end within 5 s of a 100 ms deadline")
	}
	if took := time.Since(start); took < 100*time.Millisecond {
		t.Fatalf("the context ended after %v, before its deadline", took)
	}
	if err := ctx.Err(); err != context.DeadlineExceeded {
		t.Fatalf("Err() = %v; want context.DeadlineExceeded", err)
	}
	if cause := context.Cause(ctx); cause != context.DeadlineExceeded {
		t.Fatalf("Cause() = %v; want context.DeadlineExceeded", cause)
	}
	<-child.Done()
	if cause := context.Cause(child); cause != context.DeadlineExceeded {
		t.Fatalf("a child's Cause() = %v; want context.DeadlineExceeded", cause)
	}
}

// TestDeadlinesRelease: a context released before its deadline ends with
// context.Canceled and is forgotten, and the ticking goroutine stops once
// no context has been pending for deadlinesIdle.
func TestDeadlinesRelease(t *testing.T) {
	d := newDeadlines(time.Second)
	ctx, cancel := d.within(context.Background(), time.Hour)
	cancel()
	if err := ctx.Err(); err != context.Canceled {
		t.Fatalf("Err() after release = %v; want context.Canceled", err)
	}
	d.mu.Lock()
	pending := len(d.pending)
	d.mu.Unlock()
	if pending != 0 {
		t.Fatalf("%d contexts pending after release; want 0", pending)
	}
	deadline := time.Now().Add(deadlinesIdle + 5*time.Second)
	for {
		d.mu.Lock()
		running := d.running
		d.mu.Unlock()
		if !running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ticking goroutine still runs %v after the last release", deadlinesIdle+5*time.Second)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// It starts again for the next context.
	ctx, cancel = d.within(context.Background(), 50*time.Millisecond)
	defer cancel()
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a context bounded after the goroutine stopped did not end")
	}
}

// TestDeadlinesKeepTheSoonerDeadline: a caller's sooner deadline bounds
// the context; the caller's cancellation ends it; a deadline already past
// ends it at once; a Timeout too short to tick gets a timer of its own.
func TestDeadlinesKeepTheSoonerDeadline(t *testing.T) {
	d := newDeadlines(time.Second)
	soon := time.Now().Add(20 * time.Millisecond)
	parent, cancelParent := context.WithDeadline(context.Background(), soon)
	defer cancelParent()
	ctx, cancel := d.within(parent, time.Hour)
	defer cancel()
	if dl, _ := ctx.Deadline(); !dl.Equal(soon) {
		t.Fatalf("Deadline() = %v; want the caller's %v", dl, soon)
	}
	<-ctx.Done()
	if err := ctx.Err(); err != context.DeadlineExceeded {
		t.Fatalf("Err() = %v; want context.DeadlineExceeded", err)
	}

	parent, cancelParent = context.WithCancel(context.Background())
	ctx, cancel = d.within(parent, time.Hour)
	defer cancel()
	cancelParent()
	<-ctx.Done()
	if err := ctx.Err(); err != context.Canceled {
		t.Fatalf("Err() after the caller's cancellation = %v; want context.Canceled", err)
	}

	ctx, cancel = d.until(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if err := ctx.Err(); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Err() of a deadline already past = %v; want context.DeadlineExceeded", err)
	}

	// A deadline much sooner than the Timeout is not left to a tick of a
	// sixteenth of the Timeout.
	start := time.Now()
	ctx, cancel = d.until(context.Background(), start.Add(20*time.Millisecond))
	defer cancel()
	if _, ok := ctx.(*boundCtx); ok {
		t.Fatal("a deadline sooner than half the Timeout was bounded by ticks")
	}
	<-ctx.Done()

	short := newDeadlines(minTickedTimeout - time.Millisecond)
	ctx, cancel = short.within(context.Background(), time.Millisecond)
	defer cancel()
	if _, ok := ctx.(*boundCtx); ok {
		t.Fatal("a Timeout under minTickedTimeout was bounded by ticks")
	}
	<-ctx.Done()
}
