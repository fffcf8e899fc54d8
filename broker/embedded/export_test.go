package embedded

// HoldLogins has every login the broker accepts call hold first, before
// it notes a bridge back (bridgeBack). Call it before Start.
func HoldLogins(s *Server, hold func()) {
	next := s.auth.connected
	s.auth.connected = func(id Identity) {
		hold()
		next(id)
	}
}
