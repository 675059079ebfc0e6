module github.com/pgrl/pgrl/ulule

go 1.26.0

replace github.com/pgrl/pgrl => ../

require (
	github.com/jackc/pgx/v5 v5.12.0
	github.com/pgrl/pgrl v0.0.0-00010101000000-000000000000
	github.com/redis/go-redis/v9 v9.0.4
	github.com/stretchr/testify v1.12.1
	github.com/ulule/limiter/v3 v3.11.2
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/dgryski/go-rendezvous v0.0.0-20200823014737-9f7001d12a5f // indirect
	github.com/golang-migrate/migrate/v4 v4.20.1 // indirect
	github.com/jackc/pgerrcode v0.0.0-20220416144525-469b46aa5efa // indirect
	github.com/jackc/pgpassfile v1.0.0 // indirect
	github.com/jackc/pgservicefile v0.0.0-20240606120523-5a60cdf6a761 // indirect
	github.com/jackc/puddle/v2 v2.2.3 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/sync v0.23.0 // indirect
	golang.org/x/text v0.42.0 // indirect
)
