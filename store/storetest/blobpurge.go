package storetest

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// PurgeBlobs deletes the blobs last stored before the time given that no
// unfinished command, firmware or app release references; a final
// command's blob goes (its command keeps the digest), and content stored
// again since that time stays however old its blob.
func testPurgeBlobs(t *testing.T, s companion.Store) {
	ctx := t.Context()
	contents := map[string][]byte{}
	put := func(name string) companion.Blob {
		t.Helper()
		// Over a PostgreSQL chunk (256 KiB): several chunks to delete.
		content := []byte(strings.Repeat(name+" ", 300<<10/(len(name)+1)))
		b, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
		require.NoError(t, err, "PutBlob(%s)", name)
		contents[b.SHA256] = content
		return b
	}
	unreferenced := put("unreferenced")
	forOpen := put("for an open command")
	forFinal := put("for a command that ends")
	forFirmware := put("firmware")
	forApp := put("app package")
	storedAgain := put("stored again")

	openCmd := newCmd("d1")
	openCmd.Blob = forOpen.SHA256
	openCmd = create(t, s, openCmd)
	finalCmd := newCmd("d1")
	finalCmd.Blob = forFinal.SHA256
	finalCmd = setState(t, s, create(t, s, finalCmd).ID, companion.StateSucceeded)
	require.NoError(t, s.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: "1.0.0", SHA256: forFirmware.SHA256, Size: forFirmware.Size}))
	require.NoError(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: forApp.SHA256, Size: forApp.Size}))

	n, err := s.PurgeBlobs(ctx, unreferenced.CreatedAt.Add(-time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "PurgeBlobs(before everything)")

	// The store's clock must move between the old blobs and the new;
	// sleeping is the only way to move a clock the suite cannot set.
	time.Sleep(20 * time.Millisecond)
	recent := put("stored after the cut")
	last := storedAgain.CreatedAt
	require.True(t, recent.CreatedAt.After(last), "the store's clock did not move in 20ms: %v, %v", last, recent.CreatedAt)
	cut := last.Add(recent.CreatedAt.Sub(last) / 2)
	again := put("stored again")
	sameBlob(t, "PutBlob(stored again)", again, storedAgain)

	n, err = s.PurgeBlobs(ctx, cut)
	require.NoError(t, err)
	assert.Equal(t, 2, n, "PurgeBlobs: the unreferenced blob and the final command's")
	for _, tt := range []struct {
		name string
		b    companion.Blob
		want error
	}{
		{"unreferenced", unreferenced, companion.ErrNotFound},
		{"a final command's", forFinal, companion.ErrNotFound},
		{"an open command's", forOpen, nil},
		{"a firmware's", forFirmware, nil},
		{"an app release's", forApp, nil},
		{"stored again after the cut", storedAgain, nil},
		{"stored after the cut", recent, nil},
	} {
		_, err := s.Blob(ctx, tt.b.SHA256)
		wantErr(t, err, tt.want, "Blob(the "+tt.name+" blob)")
		if tt.want != nil {
			_, _, err := s.OpenBlob(ctx, tt.b.SHA256)
			wantErr(t, err, tt.want, "OpenBlob(the "+tt.name+" blob)")
			continue
		}
		data, _ := readBlob(t, s, tt.b.SHA256)
		assert.True(t, bytes.Equal(data, contents[tt.b.SHA256]), "the %s blob: %d bytes; want the %d stored", tt.name, len(data), len(contents[tt.b.SHA256]))
	}
	got, err := s.Command(ctx, finalCmd.ID)
	require.NoError(t, err)
	assert.Equal(t, forFinal.SHA256, got.Blob, "a final command keeps the digest of its purged blob")

	n, err = s.PurgeBlobs(ctx, cut)
	require.NoError(t, err)
	assert.Equal(t, 0, n, "PurgeBlobs again")

	// Once its command ends, the open command's blob goes too.
	setState(t, s, openCmd.ID, companion.StateCanceled)
	n, err = s.PurgeBlobs(ctx, cut)
	require.NoError(t, err)
	assert.Equal(t, 1, n, "PurgeBlobs after the open command ended")
	_, _, err = s.OpenBlob(ctx, forOpen.SHA256)
	assert.ErrorIs(t, err, companion.ErrNotFound, "OpenBlob(the ended command's blob)")

	// Purged content may be stored again, whole.
	b := put("unreferenced")
	assert.Equal(t, unreferenced.SHA256, b.SHA256)
	data, _ := readBlob(t, s, b.SHA256)
	assert.True(t, bytes.Equal(data, contents[b.SHA256]), "content stored again after its purge: %d bytes; want %d", len(data), len(contents[b.SHA256]))
}

// Content stored again while a purge that would delete its blob runs is
// there, whole, once both returned: either the purge went first and
// PutBlob stored it anew, or PutBlob refreshed it first and the purge
// kept it; never a record without its content.
func testPurgeBlobsRacesPutBlob(t *testing.T, s companion.Store) {
	ctx := t.Context()
	content := bytes.Repeat([]byte("photo "), 50<<10) // two PostgreSQL chunks
	sha := shaHex(content)
	for round := range 50 {
		_, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
		require.NoError(t, err)
		time.Sleep(time.Millisecond)
		// Stored after the photo, by the store's clock: a cutoff the
		// photo falls before, unless stored again.
		marker, err := s.PutBlob(ctx, strings.NewReader(fmt.Sprint("marker ", round)), 0)
		require.NoError(t, err)
		// The purge starts a millisecond later each round (up to 24),
		// so that in some round it finds the photo old just before the
		// PutBlob refreshes it, and comes to delete it just after.
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
			assert.NoError(t, err, "PutBlob(again)")
		}()
		time.Sleep(time.Duration(round%25) * time.Millisecond)
		go func() {
			defer wg.Done()
			_, err := s.PurgeBlobs(ctx, marker.CreatedAt)
			assert.NoError(t, err, "PurgeBlobs")
		}()
		wg.Wait()
		data, _ := readBlob(t, s, sha)
		require.True(t, bytes.Equal(data, content), "round %d: %d bytes; want the %d stored", round, len(data), len(content))
	}
}
