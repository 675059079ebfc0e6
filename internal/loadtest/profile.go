package loadtest

import (
	"os"
	"runtime/pprof"
)

// StartCPUProfile writes a Go CPU profile of this process to the file at
// path (created or truncated), for go tool pprof, until stop is called.
func StartCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}
