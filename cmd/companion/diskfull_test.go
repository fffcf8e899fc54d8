package main

import (
	"bytes"
	"encoding/base64"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestDiskFullIs503 runs the real server on its bbolt store while no file
// of the process can be written (a file size limit of 0, as a full disk):
// a command and an upload are each a 503 unavailable with Retry-After,
// never a 500 and never a 202 not on disk; once the disk takes writes
// again the same requests are accepted, without a restart, and the
// commands accepted before are there.
func TestDiskFullIs503(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	before := f.user.pushText("dev-1", "before")

	lift := testenv.LimitFileSize(t, 0)
	img := base64.StdEncoding.EncodeToString(pngImage(t, 64, 64))
	requests := []struct {
		name         string
		c            *client
		method, path string
		body         any
	}{
		{"a text", f.user, "POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "while full"}},
		{"an image", f.user, "POST", "/api/v1/devices/dev-1/push/image", map[string]any{"image": img, "content_type": "image/png"}},
		{"an app upload", f.admin, "PUT", "/api/v1/admin/apps/clock/1.0.0", bytes.Repeat([]byte("app"), 1000)},
	}
	for _, q := range requests {
		r := q.c.do(q.method, q.path, q.body)
		require.Equal(t, 503, r.Status, "%s while the disk is full: %s", q.name, r.Body)
		require.Equal(t, "unavailable", r.JSON(t)["code"], "%s", q.name)
		require.NotEmpty(t, r.Header.Get("Retry-After"), "%s", q.name)
	}

	lift()
	readyAgain(t, newClient(t, m, ""))
	for _, q := range requests {
		r := q.c.do(q.method, q.path, q.body)
		require.Contains(t, []int{201, 202}, r.Status, "%s once the disk takes writes: %s", q.name, r.Body)
	}
	r = f.user.do("GET", "/api/v1/devices/dev-1/commands/"+before, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
}

// TestReadyzWhileTheDiskIsFull: /readyz says not ready once a write of
// the bbolt store failed for its disk, and ready again once the disk takes
// writes, with no other request to show it.
func TestReadyzWhileTheDiskIsFull(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	probe := newClient(t, m, "")
	require.Equal(t, 200, probe.do("GET", "/readyz", nil).Status)

	lift := testenv.LimitFileSize(t, 0)
	r = f.user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "while full"})
	require.Equal(t, 503, r.Status, "%s", r.Body)
	readyzCannotWrite(t, probe, "cannot write to its disk")

	lift()
	readyAgain(t, probe)
	f.user.pushText("dev-1", "space back")
}

// readyAgain waits for /readyz to answer 200 once the disk takes writes
// again: the store tries a commit again only every few seconds while its
// disk is full (bug 342), as a load balancer polls /readyz.
func readyAgain(t *testing.T, probe *client) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "/readyz to answer 200 once the disk takes writes", func() bool {
		return probe.do("GET", "/readyz", nil).Status == 200
	})
}

// readyzCannotWrite checks that /readyz answers 503 not_ready, its detail
// containing detail, twice: the second asks the store again, and is
// refused again.
func readyzCannotWrite(t *testing.T, probe *client, detail string) {
	t.Helper()
	for range 2 {
		r := probe.do("GET", "/readyz", nil)
		require.Equal(t, 503, r.Status, "/readyz while the store cannot write: %s", r.Body)
		p := r.JSON(t)
		require.Equal(t, "not_ready", p["code"])
		require.Contains(t, p["detail"], detail)
	}
}

// TestStoreFaultMetricWhileTheDiskIsFull: companion_store_fault says the
// bbolt store's disk refuses writes from the first write it refused until
// one commits again, so that an alert sees it even when /readyz's 503 has
// the load balancer send the server nothing (bug 340).
func TestStoreFaultMetricWhileTheDiskIsFull(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	m := startServer(t, Config{Metrics: "127.0.0.1:0"})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	scrape := metricsScrape(t, m)
	require.True(t, scrape.Has("companion_store_fault", "fault", "cannot write"), "no companion_store_fault{fault=\"cannot write\"}:\n%s", scrape.Dump("companion_store_fault"))
	metricsExpect(t, scrape, 0, "companion_store_fault", "fault", "cannot write")
	metricsExpect(t, scrape, 0, "companion_store_fault", "fault", "not answering")

	lift := testenv.LimitFileSize(t, 0)
	r = f.user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "while full"})
	require.Equal(t, 503, r.Status, "%s", r.Body)
	metricsExpect(t, metricsScrape(t, m), 1, "companion_store_fault", "fault", "cannot write")

	lift()
	readyAgain(t, newClient(t, m, ""))
	metricsExpect(t, metricsScrape(t, m), 0, "companion_store_fault", "fault", "cannot write")
}
