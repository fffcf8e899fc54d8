package main

import "github.com/devicecompanion/companion/internal/mcuboottest"

// firmwareImage builds an MCUboot image of version of exactly size bytes.
var firmwareImage = mcuboottest.Image
