package agent

import (
	"errors"
	"fmt"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/topics"
)

// SpoolCommands leaves the spool in dir as a bridge that took cmds in and
// then crashed would: queued, the first of each device perhaps running.
func SpoolCommands(dir string, cmds []topics.Command) error {
	s, err := openSpool(dir)
	if err != nil {
		return err
	}
	defer s.close()
	_, err = s.accept(cmds, time.Now())
	return err
}

// SpoolStarted leaves the spool in dir as a bridge that took cmds in (all
// for one device), started the first n of them and crashed before any
// final reply was on disk would: its worker goes on to the next command
// while the final reply of the last one is on its way to the file.
func SpoolStarted(dir string, cmds []topics.Command, n int) (err error) {
	s, err := openSpool(dir)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, s.close()) }()
	res, err := s.accept(cmds, time.Now())
	if err != nil {
		return err
	}
	for _, r := range res {
		if r.rec != nil {
			s.release(r.rec)
		}
	}
	for _, c := range cmds[:n] {
		r := s.claimNow(c.DeviceID)
		if r == nil || r.Cmd.ID != c.ID {
			return fmt.Errorf("claimed %+v; want %s", r, c.ID)
		}
		if err := s.start(r); err != nil {
			return err
		}
	}
	return nil
}

// accept is acceptAt with every time now, as a bridge whose clock is the
// server's takes commands in.
func (s *spool) accept(cmds []topics.Command, now time.Time) ([]acceptResult, error) {
	return s.acceptAt(cmds, now, now, now)
}

// finish is finishAt with the record done at the reply's time.
func (s *spool) finish(r *record, final topics.Reply, done func(key uint64, err error)) {
	s.finishAt(r, final, final.At, done)
}

// PurgeSpool forgets old finished command ids as the hourly housekeeping
// does, and returns how many it forgot.
func (a *Agent) PurgeSpool() (int, error) { return a.purgeSpool() }

// OwedReplies is how many final replies wait in the spool's outbox for the
// broker's acknowledgement.
func (a *Agent) OwedReplies() (int, error) {
	owed, err := a.spool.owedReplies()
	return len(owed), err
}

// seen reports the spool state of a command id ("" when unknown).
func (s *spool) seen(id string) (string, error) {
	var state string
	err := s.db.View(func(tx *bolt.Tx) error {
		r, err := getRecord(tx, id)
		if r != nil {
			state = r.State
		}
		return err
	})
	return state, err
}

// SpoolState is the state of a command in the agent's spool ("" when
// unknown): queued, running (it may have started) or done.
func (a *Agent) SpoolState(id string) (string, error) {
	return a.spool.seen(id)
}

// DeliveredDelay is deliveredDelay, for tests.
const DeliveredDelay = deliveredDelay

// Failure is failure, for tests: the code and message of a failed
// command's reply.
func Failure(err error, timedOut bool, limit time.Duration) (code, message string) {
	ce := failure(err, timedOut, limit)
	return ce.Code, ce.Message
}

// MQTTClient is the bridge's paho client, for tests that look at what it
// does with its packet ids.
func (a *Agent) MQTTClient() mqtt.Client { return a.client }

// claimNow claims as the worker does, at the present time, and ignores how
// long a command that waits for its predecessor may still wait.
func (s *spool) claimNow(deviceID string) *record {
	r, _ := s.claim(deviceID, time.Now())
	return r
}

// KeptStatus is the status of a device the spool keeps (nil when none):
// what the bridge reports of it while it cannot read it, also after a
// restart.
func (a *Agent) KeptStatus(deviceID string) (*topics.Status, error) {
	return a.spool.lastStatus(deviceID)
}

// SetReportTimeout sets the bound of a report's read (30 s) for the
// package's tests, and returns a function putting it back.
func SetReportTimeout(d time.Duration) (restore func()) {
	old := reportTimeout
	reportTimeout = d
	return func() { reportTimeout = old }
}
