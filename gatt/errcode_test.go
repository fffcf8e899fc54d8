package gatt

import "testing"

// The errors img_mgmt_upload_inspect answers about the image uploaded
// (its offset, length, header, hash, and the fixed address it was built
// for) get the same failure code whether the device answers in SMP version
// 2 (err: {group 1, rc}) or in version 1, where img_mgmt_translate_error_code
// makes each of them rc 3 (EINVAL). Before, error 25 (invalid flash
// address: an image built with imgtool --rom-fixed for the other slot of a
// direct-XIP device) was device_error in version 2 and invalid_payload in
// version 1 (docs/reliability.md, bug 506).
func TestImageErrorsOfTheImageAgreeAcrossSMPVersions(t *testing.T) {
	for _, grc := range []int{ImgErrInvalidOffset, ImgErrInvalidLength, ImgErrInvalidImageHeader,
		ImgErrInvalidHash, ImgErrInvalidFlashAddress} {
		v2 := &Error{Group: GroupImage, ID: CmdImageUpload, GroupRC: grc}
		v1 := &Error{Group: GroupImage, ID: CmdImageUpload, RC: RCInvalid}
		if v2.ErrorCode() != v1.ErrorCode() || v2.ErrorCode() != CodeInvalidPayload {
			t.Errorf("img_mgmt error %d (%s): version 2 answer is %q, version 1 (rc 3) %q; want both %q",
				grc, groupErrName(GroupImage, grc), v2.ErrorCode(), v1.ErrorCode(), CodeInvalidPayload)
		}
	}
}
