package main

import (
	"context"
	"maps"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgrl/pgrl/internal/loadtest"
)

// tableCounters are one table's update counters from pg_stat_user_tables.
type tableCounters struct {
	Updates    int64 `json:"updates"`
	HotUpdates int64 `json:"hot_updates"`
}

// tableStats reads the update counters of the tables in schema.
func tableStats(ctx context.Context, conn *pgx.Conn, schema string) (map[string]tableCounters, error) {
	rows, err := conn.Query(ctx, `
		SELECT relname, n_tup_upd, n_tup_hot_upd
		  FROM pg_stat_user_tables
		 WHERE schemaname = $1`, schema)
	if err != nil {
		return nil, err
	}
	out := map[string]tableCounters{}
	for rows.Next() {
		var name string
		var c tableCounters
		if err := rows.Scan(&name, &c.Updates, &c.HotUpdates); err != nil {
			return nil, err
		}
		out[name] = c
	}
	return out, rows.Err()
}

// settledTableStats reads the counters once the benchmark's connections
// have reported theirs. Backends send their statistics to the cumulative
// statistics system at most once a second and when they exit (the pools are
// closed by now), so read until two reads a moment apart agree.
func settledTableStats(ctx context.Context, conn *pgx.Conn, schema string, versionNum int) (map[string]tableCounters, error) {
	if versionNum >= 150000 {
		if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			return nil, err
		}
	}
	prev, err := tableStats(ctx, conn, schema)
	if err != nil {
		return nil, err
	}
	for range 20 {
		select {
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		cur, err := tableStats(ctx, conn, schema)
		if err != nil {
			return nil, err
		}
		if maps.Equal(cur, prev) {
			return cur, nil
		}
		prev = cur
	}
	return prev, nil
}

// hotRatios returns, for every table updated between the two readings, the
// share of its updates that were HOT, and the counts behind it.
func hotRatios(before, after map[string]tableCounters) (map[string]float64, map[string]tableCounters) {
	ratios := map[string]float64{}
	counts := map[string]tableCounters{}
	for name, a := range after {
		b := before[name]
		d := tableCounters{Updates: a.Updates - b.Updates, HotUpdates: a.HotUpdates - b.HotUpdates}
		if d.Updates <= 0 {
			continue
		}
		counts[name] = d
		ratios[name] = loadtest.Round(float64(d.HotUpdates)/float64(d.Updates), 4)
	}
	return ratios, counts
}
