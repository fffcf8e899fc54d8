// Package envflag reads flags from the environment: every flag of a
// FlagSet not given on the command line takes PREFIX<FLAG> when it is set,
// with the flag's name upper-cased and dashes as underscores
// (--mqtt-url → COMPANION_MQTT_URL). Flags given on the command line win.
package envflag

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Name is the environment variable of a flag.
func Name(prefix, flagName string) string {
	return prefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Apply fills the flags of fs that were not set on the command line (call
// it after fs.Parse) from the environment, through fs.Set: fs.Visit then
// counts them as given, as those of the command line. The error names the
// variable, its value and the flag, and for a boolean flag the values it
// takes (the flag package says only "parse error").
func Apply(fs *flag.FlagSet, prefix string) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		name := Name(prefix, f.Name)
		if v, ok := os.LookupEnv(name); ok {
			if e := fs.Set(f.Name, v); e != nil {
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
					err = fmt.Errorf("%s: invalid value %q for --%s: want true or false (1, t, T, TRUE, True, or 0, f, F, FALSE, False)", name, v, f.Name)
					return
				}
				err = fmt.Errorf("%s: invalid value %q for --%s: %v", name, v, f.Name, e)
			}
		}
	})
	return err
}
