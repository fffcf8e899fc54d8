package mqtttest_test

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// docs/mosquitto.md's table "What Mosquitto is set to, and why" says, row
// by row, what mosquitto.conf sets: each setting it names is set in the
// file to the value the row gives, so that the reasons an operator reads
// are those of the file they install.
func TestMosquittoDocSettingsAreTheConf(t *testing.T) {
	conf := map[string]string{}
	for _, line := range strings.Split(string(testenv.ReadRepoFile(t, "mosquitto.conf")), "\n") {
		if line = strings.TrimSpace(line); line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, value, _ := strings.Cut(line, " ")
		conf[name] = strings.TrimSpace(value)
	}
	doc := string(testenv.ReadRepoFile(t, "docs/mosquitto.md"))
	_, table, ok := strings.Cut(doc, "## 6. What Mosquitto is set to, and why\n")
	require.True(t, ok, "docs/mosquitto.md has section 6")
	table, _, _ = strings.Cut(table, "\n## ")
	tick := regexp.MustCompile("`([^`]+)`")
	rows := 0
	for _, line := range strings.Split(table, "\n") {
		cells := strings.Split(line, " | ")
		if !strings.HasPrefix(line, "| `") || len(cells) < 3 {
			continue
		}
		rows++
		var names, values []string
		for _, m := range tick.FindAllStringSubmatch(cells[0], -1) {
			names = append(names, m[1])
		}
		for _, m := range tick.FindAllStringSubmatch(cells[1], -1) {
			values = append(values, m[1])
		}
		require.Len(t, values, len(names), "docs/mosquitto.md: %s", line)
		for i, name := range names {
			v, set := conf[name]
			if assert.True(t, set, "docs/mosquitto.md names %s, which mosquitto.conf does not set", name) {
				assert.Equal(t, values[i], v, "docs/mosquitto.md: %s", name)
			}
		}
	}
	require.GreaterOrEqual(t, rows, 9, "rows of section 6's table")
	// max_packet_size is topics.MaxPayload plus 64 KiB of topic and
	// headers, as the row says.
	assert.Equal(t, strconv.Itoa(topics.MaxPayload+64<<10), conf["max_packet_size"])
}
