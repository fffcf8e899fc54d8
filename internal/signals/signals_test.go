package signals

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// childEnv makes the test binary the child of TestSecondSignalKills.
const childEnv = "SIGNALS_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		ctx, stop := Context()
		defer stop()
		fmt.Println("ready")
		<-ctx.Done()
		fmt.Println("shutting down") // at once: the second signal may come now
		time.Sleep(time.Minute)      // a slow shutdown
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The first SIGTERM ends the context; a second one, sent the moment the
// shutdown has begun, kills the process. Before, the signals were given
// back on a goroutine of their own, and a second signal sent then could be
// swallowed: the process waited out its shutdown (docs/reliability.md,
// bug 95).
func TestSecondSignalKills(t *testing.T) {
	for range 20 {
		self, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(self)
		cmd.Env = append(os.Environ(), childEnv+"=1")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lines := bufio.NewScanner(out)
		next := func(want string) {
			t.Helper()
			if !lines.Scan() || lines.Text() != want {
				cmd.Process.Kill()
				cmd.Wait()
				t.Fatalf("child said %q; want %q", lines.Text(), want)
			}
		}
		next("ready")
		cmd.Process.Signal(syscall.SIGTERM)
		next("shutting down")
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err = <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Fatal("the second SIGTERM did not end the child")
		}
		var ee *exec.ExitError
		if !errors.As(err, &ee) || !ee.Sys().(syscall.WaitStatus).Signaled() {
			t.Fatalf("child ended with %v; want killed by the second SIGTERM", err)
		}
	}
}
