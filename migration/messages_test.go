package migration_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/migration"
)

// The layout switch's "not migrated" error names the database, the user
// and the schema it looked in.
func TestSetLayoutNotMigratedNamesWhere(t *testing.T) {
	t.Parallel()
	s := dbtest.NewSchema(t)
	m := newMigrator(t, migration.Config{Schema: s})
	_, err := m.SetLayout(context.Background(), migration.LayoutPartitioned, time.Hour)
	require.ErrorIs(t, err, migration.ErrNotMigrated)
	require.Contains(t, err.Error(), "in database pgrl_test, schema "+s+" (looked in as user postgres) is at version 0")
	require.Contains(t, err.Error(), "rl-migrate --schema "+s+" up")
}

// recordHandler keeps the log records.
type recordHandler struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}
func (h *recordHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrHandler{h: h, attrs: as}
}
func (h *recordHandler) WithGroup(string) slog.Handler { return h }

type attrHandler struct {
	h     *recordHandler
	attrs []slog.Attr
}

func (a *attrHandler) Enabled(context.Context, slog.Level) bool { return true }
func (a *attrHandler) Handle(ctx context.Context, r slog.Record) error {
	r = r.Clone()
	r.AddAttrs(a.attrs...)
	return a.h.Handle(ctx, r)
}
func (a *attrHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrHandler{h: a.h, attrs: append(append([]slog.Attr{}, a.attrs...), as...)}
}
func (a *attrHandler) WithGroup(string) slog.Handler { return a }

// Each migration is logged once, with the time it took itself: the times
// add up to no more than the whole Up.
func TestLogTimesArePerMigration(t *testing.T) {
	t.Parallel()
	h := &recordHandler{}
	m := newMigrator(t, migration.Config{Schema: dbtest.NewSchema(t), Logger: slog.New(h)})
	start := time.Now()
	_, err := m.Up(context.Background())
	elapsed := time.Since(start)
	require.NoError(t, err)
	var sum time.Duration
	var msgs []string
	for _, r := range h.records {
		msgs = append(msgs, r.Message)
		var took string
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "took" {
				took = a.Value.String()
			}
			return true
		})
		if took == "" {
			continue
		}
		d, err := time.ParseDuration(took)
		require.NoError(t, err)
		sum += d
	}
	var want []string
	for _, a := range migration.Available() {
		want = append(want, "applied migration "+a.String())
	}
	require.Subset(t, msgs, want)
	require.Len(t, msgs, len(want), "one line per migration: %q", msgs)
	require.LessOrEqual(t, sum, elapsed, fmt.Sprintf("%q", msgs))
}
