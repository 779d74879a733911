package ticketd

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// PROTOCOL §6.1: a permit of "pool", a semaphore of 8, wait=5, lease=30,
// owner 7, and the answer when "pool" is registered with a limit of 4.
const (
	specPermitRequest = "50 05 1E 00 00 00 00 00 00 00 07 00 08 53 70 6F 6F 6C 0A"
	specLimitMismatch = "4C 00 00 00 00 00 00 00 07 00 04 70 6F 6F 6C 0A"
)

func TestPermitFramesMatchTheSpecExample(t *testing.T) {
	if got, want := appendAcquireWithLimit(nil, 5, 30, 7, Semaphore(8), "pool"), unhex(t, specPermitRequest); !bytes.Equal(got, want) {
		t.Fatalf("acquire with limit % x, want % x", got, want)
	}
	x := appendAcquireWithLimit(nil, 0, 1, 0x0A, ExclusivePlaces(), "k")
	if want := append(unhex(t, "50 00 01 00 00 00 00 00 00 00 0A FF FF 58"), 'k', '\n'); !bytes.Equal(x, want) {
		t.Fatalf("exclusive % x, want % x", x, want)
	}
	full := unhex(t, specLimitMismatch)
	for i := 0; i < len(full); i++ {
		if _, _, err := decodeReply(full[:i], 1024); err != errNeedMore {
			t.Fatalf("prefix of %d bytes: %v", i, err)
		}
	}
	r, used, err := decodeReply(append(full, 'T'), 1024)
	if want := (reply{op: opLimitMismatch, a: 7, key: "pool", limit: 4}); err != nil || r != want || used != len(full) {
		t.Fatalf("decoded %+v %d %v, want %+v", r, used, err, want)
	}
	// Its header may hold newlines: owner 0x0A, limit 0x0A0A.
	nl := unhex(t, "4C 00 00 00 00 00 00 00 0A 0A 0A 6B 0A")
	r, _, err = decodeReply(nl, 1024)
	if want := (reply{op: opLimitMismatch, a: 0x0A, key: "k", limit: 0x0A0A}); err != nil || r != want {
		t.Fatalf("decoded %+v %v, want %+v", r, err, want)
	}
}

func TestALimitOfZeroIsRefusedBeforeAnythingIsSent(t *testing.T) {
	f := startFake(t, nil)
	c := dial(t, f.addr())
	ctx := within(time.Second)
	if _, err := c.AcquirePermit(ctx, "k", 0, time.Second); !errors.Is(err, ErrInvalid) {
		t.Fatalf("limit 0: %v", err)
	}
	if _, err := c.TryAcquireWith(ctx, "k", &Places{Limit: 0, Mode: ModeExclusive}, time.Second); !errors.Is(err, ErrInvalid) {
		t.Fatalf("limit 0, exclusive: %v", err)
	}
	if _, err := c.AcquireWith(ctx, "k", &Places{Limit: 2, Mode: 'Q'}, time.Second); !errors.Is(err, ErrInvalid) {
		t.Fatalf("mode Q: %v", err)
	}
	if c.Connections() != 0 {
		t.Fatal("a connection was opened for a bad argument")
	}
	if p := SharedPlaces(); p != (Places{Limit: 65535, Mode: 'S'}) {
		t.Fatalf("shared places %+v", p)
	}
}

func TestAnLIsMatchedByOwnerAndIsFinal(t *testing.T) {
	f := startFake(t, func(conn net.Conn, r request) {
		if r.op != opAcquireWithLimit {
			return
		}
		l := append([]byte{opLimitMismatch}, ownerBytes(r.id, r.key)...)
		l = append(l[:9], append([]byte{0, 4}, l[9:]...)...)
		// Split across reads.
		_, _ = conn.Write(l[:5])
		time.Sleep(50 * time.Millisecond)
		_, _ = conn.Write(l[5:])
	})
	c := dial(t, f.addr())
	_, err := c.AcquirePermit(within(5*time.Second), "pool", 8, time.Second)
	var e *Error
	if !errors.Is(err, ErrLimitMismatch) || !errors.Is(err, ErrNotAcquired) || !errors.As(err, &e) || e.Limit != 4 {
		t.Fatalf("got %v, want ErrLimitMismatch with the limit 4", err)
	}
	r := f.next(t)
	if r.op != opAcquireWithLimit || r.places != Semaphore(8) || r.lease != 1 {
		t.Fatalf("sent %+v", r)
	}
	select {
	case r := <-f.requests:
		t.Fatalf("sent again: %+v", r)
	case <-time.After(100 * time.Millisecond):
	}
}

func TestAnLForAPlainAcquireIsIndeterminateAndClosesTheSession(t *testing.T) {
	f := startFake(t, func(conn net.Conn, r request) {
		l := append([]byte{opLimitMismatch}, ownerBytes(r.id, r.key)...)
		_, _ = conn.Write(append(l[:9], append([]byte{0, 1}, l[9:]...)...))
	})
	c := dial(t, f.addr())
	if _, err := c.Acquire(within(5*time.Second), "m", time.Second); !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("got %v, want ErrIndeterminate", err)
	}
	select {
	case <-f.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the session was kept")
	}
}

func TestALatePermitIsGivenBack(t *testing.T) {
	released := make(chan request, 1)
	f := startFake(t, func(conn net.Conn, r request) {
		switch r.op {
		case opAcquireWithLimit:
			// Answer after D (1 s) but before D + 1 s.
			time.Sleep(1300 * time.Millisecond)
			_, _ = conn.Write(append([]byte{opAcquire, 0, 0, 0, 0, 0, 0, 0, 78}, ownerBytes(r.id, r.key)...))
		case opRelease:
			released <- r
			_, _ = conn.Write(appendRelease(nil, r.id, r.key))
		}
	})
	c := dial(t, f.addr())
	_, err := c.AcquireShared(within(time.Second), "late", 5*time.Second)
	if !errors.Is(err, ErrIndeterminate) || !errors.Is(err, errLateGrant) {
		t.Fatalf("err %v", err)
	}
	select {
	case r := <-released:
		if r.id != 78 || r.key != "late" {
			t.Fatalf("released %+v", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the late grant was not given back")
	}
}

// acquireInBackground runs acquire on a goroutine; its outcome comes on
// the channel.
func acquireInBackground(acquire func() (*Ticket, error)) chan *Ticket {
	out := make(chan *Ticket, 1)
	go func() {
		tk, _ := acquire()
		out <- tk
	}()
	return out
}

func TestASemaphoreOfTwoAgainstTheRealServer(t *testing.T) {
	s := startServer(t)
	c := newClient(t, Config{Addrs: []string{s.Addr}, PoolSize: 4})
	first, err := c.AcquirePermit(within(time.Second), "sem", 2, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.AcquirePermit(within(time.Second), "sem", 2, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if first.Token() >= second.Token() {
		t.Fatalf("tokens %d, %d", first.Token(), second.Token())
	}
	if _, err := c.TryAcquirePermit(context.Background(), "sem", 2, 30*time.Second); !errors.Is(err, ErrTimeout) {
		t.Fatalf("a third: %v, want ErrTimeout", err)
	}
	_, err = c.AcquirePermit(within(time.Second), "sem", 3, 30*time.Second)
	var e *Error
	if !errors.Is(err, ErrLimitMismatch) || !errors.As(err, &e) || e.Limit != 2 {
		t.Fatalf("another limit: %v, want ErrLimitMismatch with 2", err)
	}
	queued := acquireInBackground(func() (*Ticket, error) {
		return c.AcquirePermit(within(10*time.Second), "sem", 2, 30*time.Second)
	})
	select {
	case <-queued:
		t.Fatal("granted while both places were held")
	case <-time.After(300 * time.Millisecond):
	}
	if err := first.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	third := <-queued
	if third == nil || third.Token() <= second.Token() {
		t.Fatalf("the queued permit: %v", third)
	}
	for _, tk := range []*Ticket{second, third} {
		if err := tk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func TestAReadWriteLockAgainstTheRealServer(t *testing.T) {
	s := startServer(t)
	c := newClient(t, Config{Addrs: []string{s.Addr}, PoolSize: 4})
	r1, err := c.AcquireShared(within(time.Second), "rw", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := c.AcquireShared(within(time.Second), "rw", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	writer := acquireInBackground(func() (*Ticket, error) {
		return c.AcquireExclusive(within(10*time.Second), "rw", 30*time.Second)
	})
	select {
	case <-writer:
		t.Fatal("a writer granted beside readers")
	case <-time.After(300 * time.Millisecond):
	}
	// The queued writer holds back a later reader.
	if _, err := c.TryAcquireShared(context.Background(), "rw", 30*time.Second); !errors.Is(err, ErrTimeout) {
		t.Fatalf("a later reader: %v, want ErrTimeout", err)
	}
	if err := r1.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-writer:
		t.Fatal("a writer granted beside a reader")
	case <-time.After(200 * time.Millisecond):
	}
	if err := r2.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	w := <-writer
	if w == nil || w.Token() <= r2.Token() {
		t.Fatalf("the writer: %v", w)
	}
	if err := w.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}
