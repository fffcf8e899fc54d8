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
	const wantPort = `X_PORT: invalid value "nine" for --port: parse error`
	if err := Apply(fs, "X_"); err == nil || err.Error() != wantPort {
		t.Errorf("Apply with X_PORT=nine = %v; want %s", err, wantPort)
	}

	// A boolean flag's error says which values it takes.
	t.Setenv("X_DEMO", "maybe")
	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	fs.Bool("demo", false, "")
	fs.Parse(nil)
	const wantDemo = `X_DEMO: invalid value "maybe" for --demo: want true or false (1, t, T, TRUE, True, or 0, f, F, FALSE, False)`
	if err := Apply(fs, "X_"); err == nil || err.Error() != wantDemo {
		t.Errorf("Apply with X_DEMO=maybe = %v; want %s", err, wantDemo)
	}
	if got := Name("COMPANION_", "bridge-secret"); got != "COMPANION_BRIDGE_SECRET" {
		t.Errorf("Name = %q", got)
	}
}
