package metrics

import (
	"testing"
	"time"
)

// ShortWrites sets how long a scrape may take to be written to d, for the
// test.
func ShortWrites(t testing.TB, d time.Duration) {
	old := writeTimeout
	writeTimeout = d
	t.Cleanup(func() { writeTimeout = old })
}
