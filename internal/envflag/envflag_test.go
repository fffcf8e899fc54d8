package envflag

import (
	"flag"
	"strings"
	"testing"
)

func TestApply(t *testing.T) {
	t.Setenv("X_MQTT_URL", "tcp://from-env")
	t.Setenv("X_PORT", "9")
	t.Setenv("X_DEMO", "true")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	url := fs.String("mqtt-url", "", "")
	port := fs.Int("port", 1, "")
	demo := fs.Bool("demo", false, "")
	other := fs.String("other", "default", "")
	if err := fs.Parse([]string{"--port", "2"}); err != nil {
		t.Fatal(err)
	}
	if err := Apply(fs, "X_"); err != nil {
		t.Fatal(err)
	}
	if *url != "tcp://from-env" || *port != 2 || !*demo || *other != "default" {
		t.Errorf("got url=%q port=%d demo=%v other=%q; want the env for unset flags, the command line for port", *url, *port, *demo, *other)
	}
	var given []string
	fs.Visit(func(f *flag.Flag) { given = append(given, f.Name) })
	if strings.Join(given, ",") != "demo,mqtt-url,port" {
		t.Errorf("flags given: %q; want those of the command line and of the environment", given)
	}

	t.Setenv("X_PORT", "nine")
	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	fs.Int("port", 1, "")
	fs.Parse(nil)
	if err := Apply(fs, "X_"); err == nil {
		t.Error("a bad value from the environment was accepted")
	}
	if got := Name("COMPANION_", "bridge-secret"); got != "COMPANION_BRIDGE_SECRET" {
		t.Errorf("Name = %q", got)
	}
}
