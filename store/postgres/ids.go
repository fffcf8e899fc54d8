package postgres

import (
	"crypto/rand"
	"encoding/binary"
	"sync"
	"time"

	"github.com/google/uuid"
)

// idGen makes command ids: UUIDv7 (RFC 9562) whose 48-bit millisecond
// time and 12-bit sub-millisecond fraction (rand_a, method 3 of the RFC)
// rise strictly within the process, with 16 bits of the device's hash and
// 38 random bits in rand_b.
type idGen struct {
	mu   sync.Mutex
	last uint64 // ms<<12 | fraction of the last id made
}

// next returns the time of a new command (the store's clock, to the
// microsecond) and its id, made together under one lock, so that the ids
// this process makes rise with their times. after is the device's last
// id (the zero UUID for none): the new id is above it even when another
// replica's clock ran ahead.
func (g *idGen) next(now func() time.Time, deviceID string, after uuid.UUID) (time.Time, uuid.UUID, error) {
	g.mu.Lock()
	t := pgTime(now())
	stamp := uint64(t.UnixMilli())<<12 | uint64(t.Nanosecond()%1e6)*4096/1e6
	if stamp <= g.last {
		stamp = g.last + 1
	}
	g.last = stamp
	g.mu.Unlock()
	if prev := stampOf(after); stamp <= prev {
		stamp = prev + 1
	}
	var u uuid.UUID
	if _, err := rand.Read(u[8:]); err != nil {
		return time.Time{}, uuid.UUID{}, err
	}
	ms := stamp >> 12
	for i := range 6 {
		u[i] = byte(ms >> (40 - 8*i))
	}
	u[6] = 0x70 | byte(stamp>>8)&0x0f // version 7, top of the fraction
	u[7] = byte(stamp)
	u[8] = 0x80 | u[8]&0x3f // variant 10
	binary.BigEndian.PutUint16(u[10:12], deviceHash(deviceID))
	return t, u, nil
}

// stampOf returns the time and fraction (ms<<12 | rand_a) of an id; 0 for
// the zero UUID.
func stampOf(u uuid.UUID) uint64 {
	ms := uint64(u[0])<<40 | uint64(u[1])<<32 | uint64(u[2])<<24 | uint64(u[3])<<16 | uint64(u[4])<<8 | uint64(u[5])
	return ms<<12 | uint64(u[6]&0x0f)<<8 | uint64(u[7])
}

// commandHash returns the device hash a command id carries.
func commandHash(u uuid.UUID) uint16 {
	return binary.BigEndian.Uint16(u[10:12])
}

// validCommandID reports whether s is a command id as CreateCommand makes
// them: a UUID in its canonical lower-case form.
func validCommandID(s string) bool {
	u, err := uuid.Parse(s)
	return err == nil && u.String() == s
}
