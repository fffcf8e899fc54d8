module github.com/devicecompanion/companion

go 1.26.8

require (
	github.com/google/uuid v1.6.0
	golang.org/x/mod v0.42.0
)
