package store

import (
	"fmt"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// UpdateCommandWithReportAsync is UpdateCommandAsync that also stores the
// device's state that came with the change, in the same transaction and
// only when fn changed the command: whoever reads the command's new state
// reads that state of the device too (CONTRACT §8). The report is about the
// command's device, whatever DeviceID its Status names; a newer report
// stored already still wins, as with PutStatus and PutReportedSettings.
func (db *DB) UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	if done == nil {
		done = func(companion.Command, error) {}
	}
	if id == "" {
		done(companion.Command{}, companion.ErrNotFound)
		return
	}
	if s := report.Status; s != nil && s.BridgeID != "" && !validID(s.BridgeID) {
		done(companion.Command{}, fmt.Errorf("%w: status with bridge id %q", companion.ErrInvalid, s.BridgeID))
		return
	}
	if report.BridgeID != "" && !validID(report.BridgeID) {
		done(companion.Command{}, fmt.Errorf("%w: report of bridge id %q", companion.ErrInvalid, report.BridgeID))
		return
	}
	var (
		out   companion.Command
		final bool
	)
	db.batchAsync(func(tx *bolt.Tx) error {
		var err error
		if out, final, err = db.updateCommand(tx, id, fn); err != nil || final {
			return err
		}
		if report.Status != nil {
			s := *report.Status
			s.DeviceID = out.DeviceID
			if _, err := db.putStatus(tx, s); err != nil {
				return err
			}
		}
		if report.Settings != nil {
			// Through the bridge the caller found serving the device:
			// stored only if it serves it still (bug 289).
			applied, err := db.putReportedSettings(tx, out.DeviceID, report.BridgeID, *report.Settings)
			if err != nil {
				return err
			}
			if !applied {
				return db.withdrawDesired(tx, companion.SupersededChange(out))
			}
		}
		return db.withdrawDesired(tx, out)
	}, func(err error) {
		switch {
		case err != nil:
			done(companion.Command{}, err)
		case final:
			done(out, companion.ErrFinal)
		default:
			done(out, nil)
		}
	})
}
