package postgres_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// Of the stores campaigning on one database one dispatches at a time;
// when it goes (its session ends), another takes over.
func testOneDispatcher(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	a, b := e.open(t, dsn), e.open(t, dsn)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	changes := make(chan bool, 10)
	wg.Go(func() { a.Campaign(ctx, func(v bool) { changes <- v }) })
	select {
	case v := <-changes:
		require.True(t, v, "a's first change")
	case <-time.After(waitFor):
		t.Fatal("a never became the dispatcher")
	}
	bctx, bcancel := context.WithCancel(ctx)
	bdone := make(chan error, 1)
	go func() { bdone <- b.Campaign(bctx, nil) }()
	time.Sleep(3 * campaignTries) // b tries several times while a holds it
	assert.True(t, a.Dispatching())
	assert.False(t, b.Dispatching(), "two dispatchers at once")

	require.NoError(t, a.Close()) // a's session ends: the lock is free
	testenv.Eventually(t, waitFor, "b to take over", b.Dispatching)
	assert.False(t, a.Dispatching())
	bcancel()
	<-bdone
	assert.False(t, b.Dispatching(), "b stopped campaigning and still dispatches")
}

// campaignTries is about the pace at which a store tries for the lock.
const campaignTries = 500 * time.Millisecond
