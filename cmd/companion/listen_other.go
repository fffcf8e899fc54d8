//go:build !linux

package main

import "net"

// listenHTTP listens on addr for the HTTP API. Only on Linux does it bound
// how long a dead client holds its connection (listen_linux.go).
func listenHTTP(addr string) (net.Listener, error) { return net.Listen("tcp", addr) }
