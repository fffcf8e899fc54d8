package agent

import (
	"time"

	"github.com/devicecompanion/companion/topics"
)

// SpoolCommands leaves the spool in dir as a bridge that took cmds in and
// then crashed would: queued, the first one running when firstRunning.
func SpoolCommands(dir string, cmds []topics.Command, firstRunning bool) error {
	s, err := openSpool(dir)
	if err != nil {
		return err
	}
	defer s.close()
	res, err := s.accept(cmds, time.Now())
	if err != nil {
		return err
	}
	if firstRunning && len(cmds) > 0 {
		if _, err := s.claim(cmds[0].DeviceID, res[0].seq); err != nil {
			return err
		}
	}
	return nil
}
