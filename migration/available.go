package migration

import (
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/pgrl/pgrl/sql/schema"
)

// Migration names one embedded migration.
type Migration struct {
	// Version is the migration's number (1, 2, ...).
	Version uint `json:"version"`
	// Name is the descriptive part of the file name, e.g. "counters".
	Name string `json:"name"`
}

// String formats the migration as its file name stem, e.g. "000001_counters".
func (m Migration) String() string { return fmt.Sprintf("%06d_%s", m.Version, m.Name) }

// Direction says which half of a migration to read.
type Direction string

const (
	// Up applies a migration.
	Up Direction = "up"
	// Down reverts a migration.
	Down Direction = "down"
)

var fileName = regexp.MustCompile(`^([0-9]+)_(.+)\.(up|down)\.sql$`)

// Available returns the migrations embedded in this build, oldest first.
func Available() []Migration {
	names, err := fs.Glob(schema.FS, "*.up.sql")
	if err != nil {
		panic(err) // only on a malformed pattern
	}
	var out []Migration
	for _, n := range names {
		m := fileName.FindStringSubmatch(n)
		if m == nil {
			continue
		}
		v, err := strconv.ParseUint(m[1], 10, 32)
		if err != nil {
			continue
		}
		out = append(out, Migration{Version: uint(v), Name: m[2]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out
}

// Latest returns the newest embedded migration.
func Latest() Migration {
	all := Available()
	return all[len(all)-1]
}

// Lookup returns the embedded migration with the given version, or an
// *UnknownVersionError.
func Lookup(version uint) (Migration, error) {
	for _, m := range Available() {
		if m.Version == version {
			return m, nil
		}
	}
	return Migration{}, &UnknownVersionError{Version: version, Available: Available()}
}

// SQL returns the text of one embedded migration file, for reading or for
// applying by hand. It needs no database.
func SQL(version uint, direction Direction) (string, error) {
	if direction != Up && direction != Down {
		return "", fmt.Errorf("unknown direction %q: use up or down", direction)
	}
	m, err := Lookup(version)
	if err != nil {
		return "", err
	}
	body, err := fs.ReadFile(schema.FS, m.String()+"."+string(direction)+".sql")
	if err != nil {
		return "", err
	}
	return string(body), nil
}

// versionList formats migrations as "1 (counters), 2 (partitioning)".
func versionList(ms []Migration) string {
	parts := make([]string, len(ms))
	for i, m := range ms {
		parts[i] = fmt.Sprintf("%d (%s)", m.Version, m.Name)
	}
	return strings.Join(parts, ", ")
}
