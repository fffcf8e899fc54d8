package natsauth

// OnAnswered has r call f once each answer is sent, before the login is
// let go (for a refusal, whether it was refused).
func OnAnswered(r *Responder, f func(refused bool)) { r.answered.Store(&f) }
