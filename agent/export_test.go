package agent

import (
	"time"

	"github.com/devicecompanion/companion/topics"
)

// SpoolCommands leaves the spool in dir as a bridge that took cmds in and
// then crashed would: queued, the first one perhaps running.
func SpoolCommands(dir string, cmds []topics.Command) error {
	s, err := openSpool(dir)
	if err != nil {
		return err
	}
	defer s.close()
	_, err = s.accept(cmds, time.Now())
	return err
}

// DeliveredDelay is deliveredDelay, for tests.
const DeliveredDelay = deliveredDelay

// Failure is failure, for tests: the code and message of a failed
// command's reply.
func Failure(err error, timedOut bool, limit time.Duration) (code, message string) {
	ce := failure(err, timedOut, limit)
	return ce.Code, ce.Message
}
