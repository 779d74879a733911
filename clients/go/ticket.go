package ticketd

import (
	"context"
	"sync"
	"time"
)

// Ticket is a lock this process holds, as the server granted it.
//
// Pass Token to the resource you guard: tokens only grow, so the resource
// can refuse a request carrying a token lower than one it has seen.
// ExpiresAt is conservative: the moment the acquire (or the last extend
// answered E) was handed to the socket, plus the lease, so the server's
// lease always ends later. A Ticket is safe for use by several goroutines.
//
// Release it when done; a ticket never released ends with its lease.
type Ticket struct {
	c     *Client
	key   string
	token uint64
	lost  chan struct{}

	// extendMu: one extend at a time, the holder's or the keep-alive's.
	extendMu sync.Mutex

	mu        sync.Mutex
	lease     time.Duration
	expiresAt time.Time
	renewedAt time.Time // when the request that set expiresAt was written
	released  bool
	isLost    bool
	keep      *keepAlive
}

func newTicket(c *Client, key string, token uint64, lease time.Duration, written time.Time) *Ticket {
	return &Ticket{
		c: c, key: key, token: token, lost: make(chan struct{}),
		lease: lease, expiresAt: written.Add(lease), renewedAt: written,
	}
}

// Key is the key this ticket holds.
func (t *Ticket) Key() string { return t.key }

// Token is the grant's fencing token (an extension keeps it).
func (t *Ticket) Token() uint64 { return t.token }

// Lease is the lease of the grant or of its last extension.
func (t *Ticket) Lease() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.lease
}

// ExpiresAt is when the lock must be taken as lost (it carries Go's
// monotonic clock reading).
func (t *Ticket) ExpiresAt() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.expiresAt
}

// Remaining is the time left until ExpiresAt, 0 once it has passed.
func (t *Ticket) Remaining() time.Duration {
	if r := time.Until(t.ExpiresAt()); r > 0 {
		return r
	}
	return 0
}

// Lost is closed the moment the ticket is known lost: an extend answered
// X, or a keep-alive that missed its renewal deadline. A holder told
// "lost" must stop using the token at once.
func (t *Ticket) Lost() <-chan struct{} { return t.lost }

// IsLost reports whether the token must not be used any more: Lost is
// closed or ExpiresAt has passed.
func (t *Ticket) IsLost() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.isLost || !time.Now().Before(t.expiresAt)
}

func (t *Ticket) markLostLocked() {
	if !t.isLost {
		t.isLost = true
		close(t.lost)
	}
}

func (t *Ticket) markLost() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.markLostLocked()
}

// Extend renews the grant for lease (0: the current lease); it needs a
// protocol 1.1 server. nil: extended, ExpiresAt is now the time the
// answered Extend was written plus lease. ErrLost: an X, or no E before
// the current expiry; once lost, always lost. A lease shorter than the
// time left counts at once, answered or not. Nothing is sent once the
// local expiry has passed. If ctx ends first, the error is
// ErrIndeterminate with ctx's error, and the ticket is not lost.
func (t *Ticket) Extend(ctx context.Context, lease time.Duration) error {
	if lease == 0 {
		lease = t.Lease()
	}
	lb, err := leaseByte(lease)
	if err != nil {
		return err
	}
	t.extendMu.Lock()
	defer t.extendMu.Unlock()
	now := time.Now()
	t.mu.Lock()
	if t.released || t.isLost || !now.Before(t.expiresAt) {
		t.markLostLocked()
		t.mu.Unlock()
		return &Error{Op: "extend", Key: t.key, Kind: ErrLost}
	}
	// The server may apply a shorter lease before its answer can come.
	if e := now.Add(lease); e.Before(t.expiresAt) {
		t.expiresAt = e
	}
	until := t.expiresAt
	t.mu.Unlock()
	w, res := t.c.extendAttempts(ctx, t.key, t.token, lb, until)
	switch res {
	case extended:
		t.renewed(w, lease)
		return nil
	case extendStopped:
		return &Error{Op: "extend", Key: t.key, Kind: ErrIndeterminate, Cause: ctx.Err()}
	}
	t.markLost()
	return &Error{Op: "extend", Key: t.key, Kind: ErrLost}
}

// renewed counts an E: from the write, never from the reply.
func (t *Ticket) renewed(written time.Time, lease time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.renewedAt, t.expiresAt, t.lease = written, written.Add(lease), lease
}

// Release stops the keep-alive, if any (waiting for it to end), and
// releases the lock under the 5 s transport deadline or ctx's: nil, or an
// error that is ErrNotHeld, ErrIndeterminate or ErrNotSent (Client.Release).
func (t *Ticket) Release(ctx context.Context) error {
	t.StopRenewing()
	t.mu.Lock()
	t.released = true
	t.mu.Unlock()
	return t.c.release(ctx, t.key, t.token)
}

// keepAlive is one ticket's background renewal.
type keepAlive struct {
	stop context.CancelFunc
	done chan struct{}
}

// KeepAlive renews the ticket in the background with its lease, every
// `every` (0: a third of the lease) counted from the write of the grant or
// of the last extension answered E. Lost is closed the moment an X comes
// or a renewal has not succeeded by a tenth of the lease before the
// expiry (a dead, partitioned or stalled server is so reported while the
// lease still runs); then renewals end. Release or StopRenewing ends it.
func (t *Ticket) KeepAlive(every time.Duration) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if every == 0 {
		every = t.lease / 3
	}
	if every <= 0 || every >= t.lease*9/10 {
		return invalid("renewal interval %v must be above zero and below nine tenths of the lease", every)
	}
	if t.keep != nil || t.released {
		return invalid("the ticket is already kept alive or released")
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.keep = &keepAlive{stop: cancel, done: make(chan struct{})}
	go t.renewLoop(ctx, every, t.keep.done)
	return nil
}

// StopRenewing ends the keep-alive (an extend in flight is abandoned) and
// waits for it to end; the lock stays held until its current lease ends.
func (t *Ticket) StopRenewing() {
	t.mu.Lock()
	k := t.keep
	t.mu.Unlock()
	if k != nil {
		k.stop()
		<-k.done
	}
}

func (t *Ticket) renewLoop(ctx context.Context, every time.Duration, done chan struct{}) {
	defer close(done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		t.mu.Lock()
		wake := t.renewedAt.Add(every)
		t.mu.Unlock()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(time.Until(wake))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		if !t.renewOnce(ctx) {
			return
		}
	}
}

// renewOnce runs one renewal; false when renewals end.
func (t *Ticket) renewOnce(ctx context.Context) bool {
	t.extendMu.Lock()
	defer t.extendMu.Unlock()
	t.mu.Lock()
	lease := t.lease
	until := t.expiresAt.Add(-lease / 10)
	if t.released || t.isLost || !time.Now().Before(until) {
		t.markLostLocked()
		t.mu.Unlock()
		return false
	}
	t.mu.Unlock()
	lb, _ := leaseByte(lease)
	w, res := t.c.extendAttempts(ctx, t.key, t.token, lb, until)
	switch res {
	case extended:
		t.renewed(w, lease)
		return true
	case extendStopped:
		return false
	}
	t.markLost()
	return false
}

// Lock acquires key as Acquire does and keeps the ticket alive
// (KeepAlive(0)). Watch Lost(), and Release the ticket when done.
func (c *Client) Lock(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	t, err := c.Acquire(ctx, key, lease)
	if err != nil {
		return nil, err
	}
	if err := t.KeepAlive(0); err != nil {
		_ = t.Release(context.Background())
		return nil, err
	}
	return t, nil
}
