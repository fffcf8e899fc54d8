package main

import (
	"bufio"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/gctune"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// Both binaries, run in a container or a unit with a memory limit, tell
// their collector nine tenths of it: at their GOGC of 400 the heap grew
// to five times the live one, past the limit, and the kernel killed them
// (docs/reliability.md, bug 474). Their /metrics say so, as Go's own
// go_gc_gomemlimit_bytes and go_gc_gogc_percent.
func TestBinariesTellTheCollectorTheCgroupsMemoryLimit(t *testing.T) {
	t.Parallel()
	const limit = 512 << 20
	c := newProcCluster(t, 1)
	c.cgroup = testenv.MemoryCgroup(t, limit)
	serverMetrics := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(t))
	bridgeMetrics := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(t))
	c.serverArgs = []string{"--metrics", serverMetrics}
	c.bridgeArgs = []string{"--metrics", bridgeMetrics}
	c.startServer()
	c.setupFleet()
	c.startBridge()

	for name, addr := range map[string]string{"companion": serverMetrics, "companion-bridge": bridgeMetrics} {
		m := scrapeGauges(t, "http://"+addr+"/metrics", "go_gc_gomemlimit_bytes", "go_gc_gogc_percent")
		require.InDelta(t, limit*0.9, m["go_gc_gomemlimit_bytes"], 1, "%s in a cgroup limited to %d bytes", name, limit)
		require.Equal(t, float64(gctune.Percent), m["go_gc_gogc_percent"], name)
	}
}

// scrapeGauges reads the values of the named unlabelled series from a
// Prometheus text page, waiting for the page to answer.
func scrapeGauges(t *testing.T, url string, names ...string) map[string]float64 {
	t.Helper()
	var resp *http.Response
	testenv.Eventually(t, 20*time.Second, "GET "+url, func() bool {
		var err error
		resp, err = http.Get(url)
		return err == nil
	})
	defer resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode)
	got := map[string]float64{}
	for sc := bufio.NewScanner(resp.Body); sc.Scan(); {
		for _, n := range names {
			if v, ok := strings.CutPrefix(sc.Text(), n+" "); ok {
				f, err := strconv.ParseFloat(v, 64)
				require.NoError(t, err, "%s", sc.Text())
				got[n] = f
			}
		}
	}
	for _, n := range names {
		require.Contains(t, got, n, "%s serves no %s", url, n)
	}
	return got
}
