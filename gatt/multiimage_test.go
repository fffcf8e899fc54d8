package gatt_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// twoImages is a Connector whose links show the bridge a two-image device
// (CONFIG_MCUMGR_GRP_IMG_UPDATABLE_IMAGE_NUMBER 2, a network core's image
// beside the application's): every image state answer lists image 1's
// slots after image 0's, as img_mgmt_state_read does, image 1's second
// slot pending (an update of the other core waiting for its reboot). With
// failUpload set, every answer to an upload is rc, as a device short of
// buffers answers it. It rewrites whole messages and notifies them anew in
// writes of MTU - 3.
type twoImages struct {
	gatt.Connector
	failUpload atomic.Bool
	rc         int
	// image1, when set, adds image 1's slots to an image state instead.
	image1 func(*gatt.ImageStateResponse)
}

type twoImagesLink struct {
	gatt.Link
	c *twoImages
}

func (c *twoImages) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &twoImagesLink{Link: l, c: c}, nil
}

func (l *twoImagesLink) Subscribe(ctx context.Context, uuid string, fn func([]byte)) error {
	if uuid != gatt.SMPCharUUID {
		return l.Link.Subscribe(ctx, uuid, fn)
	}
	r := gatt.NewReassembler(gatt.MaxMessage)
	frag := l.MTU() - 3
	return l.Link.Subscribe(ctx, uuid, func(b []byte) {
		msgs, _ := r.Feed(b)
		for _, m := range msgs {
			h, body := m.Header, m.Body
			switch {
			case h.Group == gatt.GroupImage && h.ID == gatt.CmdImageState && h.Op&1 == 1:
				var st gatt.ImageStateResponse
				if gatt.DecodeBody(body, &st) == nil && len(st.Images) > 0 && l.c.image1 != nil {
					l.c.image1(&st)
					body, _ = gatt.EncodeBody(st)
				} else if len(st.Images) > 0 {
					st.Images = append(st.Images,
						gatt.ImageSlot{Image: 1, Slot: 0, Version: "0.5.0", Hash: make([]byte, 32), Bootable: true, Confirmed: true, Active: true},
						gatt.ImageSlot{Image: 1, Slot: 1, Version: "0.6.0", Hash: append(make([]byte, 31), 1), Bootable: true, Pending: true})
					body, _ = gatt.EncodeBody(st)
				}
			case h.Group == gatt.GroupImage && h.ID == gatt.CmdImageUpload && h.Op == gatt.OpWriteRsp && l.c.failUpload.Load():
				body, _ = gatt.EncodeBody(map[string]int{"rc": l.c.rc})
			}
			h.Len = uint16(len(body))
			out := append(gatt.AppendHeader(nil, h), body...)
			for off := 0; off < len(out); off += frag {
				fn(out[off:min(off+frag, len(out))])
			}
		}
	})
}

// On a two-image device the bridge updates image 0, the application (its
// upload carries no "image", which img_mgmt takes as 0), and img_mgmt
// looks for a free slot among image 0's alone (img_mgmt_slot_in_use). An
// upload that fails with an rc the bridge explains as "no free slot" when
// the other slot is pending (bug 228, 411) must not be explained by image
// 1's pending slot: that one does not stand in image 0's way, and neither
// updating to its version nor a reboot is what the operator must do. With
// image 0's own slot pending, that one is named.
func TestOTAOnATwoImageDeviceNamesImage0sPendingSlot(t *testing.T) {
	t.Run("image 1 pending, the upload short of buffers", func(t *testing.T) {
		s := sim.New(sim.Options{ID: "dev-1"})
		n := sim.NewNetwork(fastLink)
		n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
		ti := &twoImages{Connector: n, rc: gatt.RCNoMemory}
		d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: ti, MinBackoff: time.Millisecond, RequestTimeout: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			d.Close()
			n.Close()
		})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		ti.failUpload.Store(true)
		err = d.UpdateFirmware(ctx, "fw-1", "3.0.0", firmwareImage(t, "3.0.0", 20_000), nil)
		if code := errorCode(err); code != gatt.CodeDeviceError || !strings.Contains(err.Error(), "rc 2") || strings.Contains(err.Error(), "0.6.0") {
			t.Fatalf("UpdateFirmware with image 1 pending and the upload answered rc 2 = %v (code %q); want device_error, rc 2, nothing said of image 1's pending 0.6.0", err, code)
		}
	})
	t.Run("image 0 and image 1 pending", func(t *testing.T) {
		s := sim.New(sim.Options{ID: "dev-1"})
		n := sim.NewNetwork(fastLink)
		n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
		var lose atomic.Bool
		tap := func(l gatt.Link, data []byte) ([]byte, error) {
			if lose.Load() {
				return swallowReset(l, data)
			}
			return data, nil
		}
		d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: &twoImages{Connector: n}, tap: tap},
			MinBackoff: time.Millisecond, RequestTimeout: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			d.Close()
			n.Close()
		})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		lose.Store(true)
		if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0+3", firmwareImage(t, "2.0.0+3", 20_000), nil); !errors.Is(err, gatt.ErrTimeout) {
			t.Fatalf("UpdateFirmware with the reset lost = %v; want gatt.ErrTimeout", err)
		}
		lose.Store(false)
		err = d.UpdateFirmware(ctx, "fw-2", "3.0.0", firmwareImage(t, "3.0.0", 20_000), nil)
		if code := errorCode(err); code != gatt.CodeDeviceError || !strings.Contains(err.Error(), "holds firmware 2.0.0+3, to boot at the next reset") ||
			strings.Contains(err.Error(), "0.6.0") {
			t.Fatalf("UpdateFirmware to 3.0.0 = %v (code %q); want device_error naming image 0's pending 2.0.0+3, not image 1's 0.6.0", err, code)
		}
	})
}

// imageOneUnderTest makes twoImages list image 1 running an image under
// test (slot 0 active, not confirmed; slot 1 the confirmed image MCUboot
// reverts it to) rather than pending.
func imageOneUnderTest(st *gatt.ImageStateResponse) {
	st.Images = append(st.Images,
		gatt.ImageSlot{Image: 1, Slot: 0, Version: "0.6.0", Hash: append(make([]byte, 31), 1), Bootable: true, Active: true},
		gatt.ImageSlot{Image: 1, Slot: 1, Version: "0.5.0", Hash: make([]byte, 32), Bootable: true, Confirmed: true})
}

// On a two-image device whose image 1 runs an image under test, an update
// of image 0 goes through as on any device: img_mgmt takes its upload
// (image 0's slots are free), and the bridge does not reset the device to
// revert image 0 from a test it is not under. Before, the bridge took
// image 1's test for image 0's and reset the device three times before
// the upload, then failed the update "the device still runs an image
// under test after 3 resets: it does not reboot" (bug 446).
func TestOTAOnATwoImageDeviceWithImage1UnderTest(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
	ti := &twoImages{Connector: n, image1: imageOneUnderTest}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: ti, MinBackoff: time.Millisecond, RequestTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		n.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	boots := s.Boots()
	err = d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
	if err != nil || s.Firmware() != "2.0.0" || !s.FirmwareConfirmed() || s.Boots()-boots != 1 {
		t.Fatalf("UpdateFirmware with image 1 under test = %v (code %q); device runs %s (confirmed %v) after %d reboots; want nil, 2.0.0 confirmed after 1",
			err, errorCode(err), s.Firmware(), s.FirmwareConfirmed(), s.Boots()-boots)
	}
}
