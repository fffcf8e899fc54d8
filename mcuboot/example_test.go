package mcuboot_test

import (
	"fmt"

	"github.com/devicecompanion/companion/mcuboot"
)

// Build an image as imgtool would, then read it back as the server does
// when firmware is published.
func Example() {
	v, _ := mcuboot.ParseVersion("1.1.0")
	b, err := mcuboot.Build([]byte("the application"), mcuboot.Options{Version: v, HeaderSize: 0x200})
	if err != nil {
		panic(err)
	}
	img, err := mcuboot.Parse(b)
	if err != nil {
		panic(err)
	}
	fmt.Println(len(b), img.Header.Version, len(img.Hash))
	_, err = mcuboot.Parse([]byte("not an image, just bytes of a firmware"))
	fmt.Println(err)
	// Output:
	// 567 1.1.0 32
	// mcuboot: magic: 0x20746f6e is not MCUboot's 0x96f3b83d
}
