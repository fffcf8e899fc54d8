package tlsclient

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestConfig(t *testing.T) {
	c, err := Config("")
	if err != nil || c.RootCAs != nil {
		t.Errorf("Config(\"\") = %v, %v; want system roots", c, err)
	}
	if _, err := Config(filepath.Join(t.TempDir(), "missing.pem")); err == nil {
		t.Error("a missing file was accepted")
	}
	junk := filepath.Join(t.TempDir(), "junk.pem")
	os.WriteFile(junk, []byte("not a certificate"), 0o600)
	if _, err := Config(junk); err == nil {
		t.Error("a file without certificates was accepted")
	}
}

func TestIsTLSURL(t *testing.T) {
	for url, want := range map[string]bool{
		"tcp://h:1883": false, "mqtt://h:1883": false, "ws://h": false,
		"mqtts://h:8883": true, "ssl://h:8883": true, "tls://h": true, "wss://h": true,
	} {
		if got := IsTLSURL(url); got != want {
			t.Errorf("IsTLSURL(%q) = %v; want %v", url, got, want)
		}
	}
}

func TestBrokerURLs(t *testing.T) {
	got, err := BrokerURLs(" tcp://a:1883, ,tcp://b:1883,tcp://c:1883 ")
	if err != nil || len(got) != 3 || got[0] != "tcp://a:1883" || got[2] != "tcp://c:1883" {
		t.Errorf("BrokerURLs = %q, %v", got, err)
	}
	for _, good := range []string{"a:1883", ":1883", "mqtt://a:1883", "ssl://a:8883", "ws://a/mqtt", "wss://a:443/mqtt", "unix:///run/mosquitto.sock"} {
		if _, err := BrokerURLs(good); err != nil {
			t.Errorf("BrokerURLs(%q) = %v", good, err)
		}
	}
	// paho takes these and fails to dial them on every try, forever.
	for _, bad := range []string{"a", "tcp://a", "tcp://:1883", "http://a:80", "mqtt://a:1883,foo", "ws://"} {
		if _, err := BrokerURLs(bad); err == nil {
			t.Errorf("BrokerURLs(%q) took it", bad)
		}
	}
	if _, err := BrokerURLs("http://u:s3cret@a:80"); err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("BrokerURLs of a URL with credentials = %v; want an error that does not repeat them", err)
	}
	for _, bad := range []string{"", " , ", "tcp://a:1883,mqtts://b:8883"} {
		if _, err := BrokerURLs(bad); err == nil {
			t.Errorf("BrokerURLs(%q) took it", bad)
		}
	}
	if !IsTLSURL("mqtts://a:8883,mqtts://b:8883") || IsTLSURL("tcp://a:1883,tcp://b:1883") {
		t.Error("IsTLSURL of a list goes by its first URL")
	}
}
