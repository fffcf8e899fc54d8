// Package packaging holds what operators install, and its tests: the
// systemd units (systemd/), the container images (docker/), and, in the
// tests, the release binaries of make dist and their --version. It has no
// Go code of its own.
package packaging
