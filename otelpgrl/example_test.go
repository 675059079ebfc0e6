package otelpgrl_test

import (
	"context"
	"fmt"
	"log"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgrl/pgrl/internal/dbtest"
	"github.com/pgrl/pgrl/otelpgrl"
	"github.com/pgrl/pgrl/ratelimit"
)

func ExampleNewObserver() {
	pool, _, done, err := dbtest.ForExamples()
	if err != nil {
		log.Fatal(err)
	}
	defer done()
	// The application's MeterProvider; here the SDK's, read by hand.
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))

	obs, err := otelpgrl.NewObserver(mp)
	if err != nil {
		log.Fatal(err)
	}
	limits, err := ratelimit.NewDatabase(pool, ratelimit.DatabaseOptions{Observer: obs})
	if err != nil {
		log.Fatal(err)
	}
	lim, err := limits.Limiter(ratelimit.Config{Name: "api", Algorithm: ratelimit.FixedWindow, Limit: 2,
		Window: 24 * time.Hour, DenyCacheSize: -1})
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		if _, err := lim.Allow(context.Background(), "tenant-1"); err != nil {
			log.Fatal(err)
		}
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		log.Fatal(err)
	}
	for _, m := range rm.ScopeMetrics[0].Metrics {
		if m.Name != otelpgrl.Requests {
			continue
		}
		for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
			result, _ := p.Attributes.Value(otelpgrl.AttrResult)
			fmt.Printf("%s: %d\n", result.AsString(), p.Value)
		}
	}
	// Unordered output:
	// acquired: 2
	// denied: 1
}
