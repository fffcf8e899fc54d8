package companion

import "context"

// answerKey is the context key of the answer WithAnswer carries.
type answerKey struct{}

// WithAnswer returns a copy of ctx that carries rec, the answer of a
// request with an Idempotency-Key (Status and Body set, over the claim the
// request holds on its key), to the store write that does the request's
// work. The writes that take one (CreateUser, SetUserToken,
// ProvisionDevice, CreateBridge, SetBridgeSecret, DeleteBridge,
// AssignDevice, Bind when it binds, Unbind) store it in their own
// transaction, with the store's clock for a zero CreatedAt, so that the
// work and its recorded answer commit or fail together: an answer stored
// after the work could fail to be, and the repeat then did the work again
// (docs/reliability.md, bug 308). A write that finds the key held by a
// record that is not the claim of the same request (PutIdempotency's
// rule) stores nothing and returns ErrIdemConflict. Reads and other
// writes ignore it; pass it to the one write only.
func WithAnswer(ctx context.Context, rec Idempotency) context.Context {
	return context.WithValue(ctx, answerKey{}, rec)
}

// AnswerOf returns the answer ctx carries (see WithAnswer), if any.
func AnswerOf(ctx context.Context) (Idempotency, bool) {
	rec, ok := ctx.Value(answerKey{}).(Idempotency)
	return rec, ok
}
