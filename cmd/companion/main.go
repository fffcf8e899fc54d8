// Command companion is the Device Companion server and its admin CLI.
//
//	companion serve [flags]                    run the server
//	companion user create NAME                 create a user, print its API token
//	companion user token ID                    give a user a new API token, print it
//	companion device provision ID --claim-code C --model M [--bridge B]
//	companion device assign ID --bridge B | --none
//	companion bridge create ID                 create a bridge, print its secret
//	companion bridge secret ID                 give a bridge a new secret, print it
//	companion firmware publish --model M --version V FILE
//	companion app publish --app-id A --version V FILE
//	companion command wait DEVICE ID --token T  follow a command until it is final
//	companion backup FILE                      save a copy of a running server's store
//	companion --version                        print the build's version
//
// Every flag can also be set in the environment as COMPANION_<FLAG>, with
// dashes as underscores: --mqtt-url is COMPANION_MQTT_URL. Flags win.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	// The IANA time zone database, for a host without one: the
	// container images are scratch, and a timezone setting other than
	// UTC was refused there (docs/reliability.md, bug 577).
	_ "time/tzdata"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/buildinfo"
	"github.com/devicecompanion/companion/internal/envflag"
	"github.com/devicecompanion/companion/internal/flagcheck"
	"github.com/devicecompanion/companion/internal/gctune"
	"github.com/devicecompanion/companion/internal/signals"
	"github.com/devicecompanion/companion/store"
)

// version is stamped at build time (make dist: -ldflags
// "-X main.version=$(git describe --always --dirty)"); when empty,
// --version prints the VCS revision Go recorded, or "devel".
var version string

func main() {
	// The collector's target, and its memory limit in a container or a
	// unit with one (docs/reliability.md, bug 474).
	if _, err := gctune.Set(); err != nil {
		fmt.Fprintln(os.Stderr, "companion: the cgroup's memory limit, left unset:", err)
	}
	// The first signal starts a graceful shutdown; a second one, during a
	// slow shutdown, kills the process.
	ctx, stop := signals.Context()
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0) // -h: the flags are printed; as flag.ExitOnError does
		}
		var ee exitError
		if errors.As(err, &ee) {
			fmt.Fprintln(os.Stderr, "companion:", err)
			os.Exit(ee.code)
		}
		var ue usageError
		if errors.As(err, &ue) {
			fmt.Fprintln(os.Stderr, "companion:", err)
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "companion:", err)
		if errors.Is(err, flagcheck.ErrCannotListen) {
			// Refused again at every start (an address another process
			// holds, a port the process may not bind): as a usage
			// error, not restarted by the unit (bugs 436, 475).
			os.Exit(2)
		}
		if errors.Is(err, store.ErrDamaged) || errors.Is(err, companion.ErrSchemaTooNew) {
			os.Exit(exitDamagedData)
		}
		os.Exit(1)
	}
}

// exitDamagedData is the exit status of a server that refuses its damaged
// bbolt file (store.ErrDamaged), or a store a newer build wrote
// (companion.ErrSchemaTooNew: the binary taken back, bug 433): 65, BSD's
// EX_DATAERR. Every start would refuse it again until a person restores or
// moves it, or starts the newer build again, so the systemd unit does not
// restart on it (RestartPreventExitStatus), as it does on status 1 (bug
// 451).
const exitDamagedData = 65

// usageError is a mistake on the command line (exit status 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// commands are the CLI's commands with their arguments, as usage shows
// them.
var commands = []struct{ name, args string }{
	{"serve", "[--http ADDR] [--data DIR] [--mqtt-listen ADDR | --mqtt-url URL] [--demo] ..."},
	{"migrate", "--store postgres://USER@HOST:PORT/DB"},
	{"user create", "NAME"},
	{"user token", "ID"},
	{"device provision", "ID --claim-code CODE --model MODEL [--bridge BRIDGE]"},
	{"device assign", "ID --bridge BRIDGE | --none"},
	{"bridge create", "ID"},
	{"bridge secret", "ID"},
	{"firmware publish", "--model MODEL --version VERSION FILE"},
	{"app publish", "--app-id APP --version VERSION FILE"},
	{"command wait", "DEVICE ID --token TOKEN [--api-url URL] [--timeout DURATION]"},
	{"backup", "FILE [--api-url URL] [--admin-token TOKEN] | --offline [--data DIR]"},
}

// usage is the CLI's usage: every command.
var usage = func() string {
	var b strings.Builder
	b.WriteString("usage:\n")
	for _, c := range commands {
		fmt.Fprintf(&b, "  companion %s %s\n", c.name, c.args)
	}
	b.WriteString("  companion --version\n")
	b.WriteString(`Run "companion COMMAND -h" for the flags of a command.`)
	return b.String()
}()

// groupUsage is the usage of the commands of group (user, device, …):
// "usage:" and a line for each.
func groupUsage(group string) (text string, subs []string) {
	var b strings.Builder
	b.WriteString("usage:")
	for _, c := range commands {
		if sub, ok := strings.CutPrefix(c.name, group+" "); ok {
			fmt.Fprintf(&b, "\n  companion %s %s", c.name, c.args)
			subs = append(subs, sub)
		}
	}
	return b.String(), subs
}

// setUsage makes -h of fs print the command's synopsis, from commands,
// then its flags.
func setUsage(fs *flag.FlagSet) {
	synopsis := fs.Name()
	for _, c := range commands {
		if c.name == fs.Name() {
			synopsis += " " + c.args
		}
	}
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: companion %s\n\nflags:\n", synopsis)
		fs.PrintDefaults()
	}
}

// subCommand reads the sub-command of a command group (user, device,
// command, …) from args, args[0] being the group: it answers a request for
// help with the group's commands (done), and a missing or unknown
// sub-command with them and a usage error (done). Otherwise it returns the
// command, "group sub".
func subCommand(args []string, stdout, stderr io.Writer) (cmd string, done bool, err error) {
	group := args[0]
	list, subs := groupUsage(group)
	switch {
	case len(args) >= 2 && isHelp(args[1]):
		fmt.Fprintln(stdout, list)
		return "", true, nil
	case len(args) < 2:
		fmt.Fprintln(stderr, list)
		return "", true, usageError{fmt.Sprintf("%s: missing sub-command (%s)", group, strings.Join(subs, " or "))}
	case !slices.Contains(subs, args[1]):
		fmt.Fprintln(stderr, list)
		return "", true, usageError{fmt.Sprintf("unknown command %q: %s takes %s", group+" "+args[1], group, strings.Join(subs, " or "))}
	}
	return group + " " + args[1], false, nil
}

// isHelp reports whether arg asks for help.
func isHelp(arg string) bool {
	switch arg {
	case "-h", "-help", "--help", "help":
		return true
	}
	return false
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprintln(stderr, usage)
		return usageError{"no command given"}
	}
	switch args[0] {
	case "serve":
		return runServe(ctx, args[1:], stdout, stderr)
	case "migrate":
		return runMigrate(ctx, args[1:], stdout, stderr)
	case "user", "device", "bridge", "firmware", "app":
		return runAdmin(ctx, args, stdout, stderr)
	case "command":
		return runCommand(ctx, args, stdout, stderr)
	case "backup":
		return runBackup(ctx, args[1:], stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprintln(stdout, usage)
		return nil
	case "--version", "-version", "version":
		fmt.Fprintln(stdout, "companion", buildinfo.Version(version))
		return nil
	}
	fmt.Fprintln(stderr, usage)
	return usageError{fmt.Sprintf("unknown command %q", args[0])}
}

// parseFlags parses args, then fills every flag not given on the command
// line from COMPANION_<FLAG> in the environment.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return flagError(err)
	}
	return applyEnv(fs)
}

// flagError makes an error of fs.Parse (an unknown flag, a value the flag
// cannot take) a usage error, exit status 2 as for one from the
// environment; -h stays flag.ErrHelp.
func flagError(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return err
	}
	return usageError{err.Error()}
}

func applyEnv(fs *flag.FlagSet) error {
	if err := envflag.Apply(fs, "COMPANION_"); err != nil {
		return usageError{err.Error()}
	}
	return nil
}
