package ticketd

// Semaphores and read/write locks (protocol 1.2, PROTOCOL §6): a key that
// admits more than one holder, each with a Ticket of its own.

import (
	"context"
	"time"
)

// Mode is which of a key's places an acquire with places asks for.
type Mode byte

const (
	// ModeShared asks for one of the key's places.
	ModeShared Mode = 'S'
	// ModeExclusive asks for the whole key: granted only when no one else
	// holds it.
	ModeExclusive Mode = 'X'
)

// ReadWriteLimit is the limit of a read/write lock: as many readers as
// the wire can count.
const ReadWriteLimit = 65535

// Places is what an acquire with places asks for: one of Limit places in
// ModeShared, or all of them in ModeExclusive. Every caller of a key must
// give the key's own Limit (1..65535).
type Places struct {
	Limit uint16
	Mode  Mode
}

// Semaphore is one permit of a counting semaphore of limit places.
func Semaphore(limit uint16) Places { return Places{Limit: limit, Mode: ModeShared} }

// SharedPlaces is a reader's place in a read/write lock.
func SharedPlaces() Places { return Places{Limit: ReadWriteLimit, Mode: ModeShared} }

// ExclusivePlaces is a writer's hold of a read/write lock.
func ExclusivePlaces() Places { return Places{Limit: ReadWriteLimit, Mode: ModeExclusive} }

// check refuses a limit of 0 and an unknown mode before anything is sent;
// nil places (a plain acquire) pass.
func (p *Places) check() error {
	if p == nil {
		return nil
	}
	if p.Limit == 0 {
		return invalid("a limit of 0 admits no holder: it must be 1..65535")
	}
	if p.Mode != ModeShared && p.Mode != ModeExclusive {
		return invalid("mode %q is neither ModeShared nor ModeExclusive", byte(p.Mode))
	}
	return nil
}

// AcquirePermit is Acquire of one permit of key as a counting semaphore of
// limit places: at most limit holders at once, each with a ticket of its
// own. A key registered with another limit gives ErrLimitMismatch, whose
// Error.Limit is the key's limit; a limit of 0 gives ErrInvalid.
func (c *Client) AcquirePermit(ctx context.Context, key string, limit uint16, lease time.Duration) (*Ticket, error) {
	p := Semaphore(limit)
	return c.AcquireWith(ctx, key, &p, lease)
}

// AcquireShared is Acquire of a reader's place in the read/write lock key:
// held beside other readers, never beside a writer, and not before a
// writer that queued first.
func (c *Client) AcquireShared(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	p := SharedPlaces()
	return c.AcquireWith(ctx, key, &p, lease)
}

// AcquireExclusive is Acquire of a writer's hold of the read/write lock
// key: alone, after every reader and writer that queued first.
func (c *Client) AcquireExclusive(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	p := ExclusivePlaces()
	return c.AcquireWith(ctx, key, &p, lease)
}

// AcquireWith is the general acquire, under the rules of Acquire: with
// places, one of places.Limit places in places.Mode, sent as an Acquire
// With Limit; with nil, a mutex (Acquire). A server older than 1.2 closes
// the connection on an Acquire With Limit, so the outcome there is
// ErrIndeterminate.
func (c *Client) AcquireWith(ctx context.Context, key string, places *Places, lease time.Duration) (*Ticket, error) {
	start := time.Now()
	wait := MaxWait
	if dl, ok := ctx.Deadline(); ok && dl.Sub(start) < wait {
		wait = dl.Sub(start)
	}
	if wait <= 0 {
		if err := c.checkAcquire(key, places, lease); err != nil {
			return nil, err
		}
		// D has passed: the request is not sent at all.
		return nil, &Error{Op: "acquire", Key: key, Kind: ErrTimeout, Cause: ctx.Err()}
	}
	return c.acquire(ctx, key, places, lease, acquirePlan(start, wait))
}

// TryAcquirePermit is AcquirePermit as one immediate attempt (TryAcquire).
func (c *Client) TryAcquirePermit(ctx context.Context, key string, limit uint16, lease time.Duration) (*Ticket, error) {
	p := Semaphore(limit)
	return c.TryAcquireWith(ctx, key, &p, lease)
}

// TryAcquireShared is AcquireShared as one immediate attempt (TryAcquire).
func (c *Client) TryAcquireShared(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	p := SharedPlaces()
	return c.TryAcquireWith(ctx, key, &p, lease)
}

// TryAcquireExclusive is AcquireExclusive as one immediate attempt
// (TryAcquire).
func (c *Client) TryAcquireExclusive(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	p := ExclusivePlaces()
	return c.TryAcquireWith(ctx, key, &p, lease)
}

// TryAcquireWith is AcquireWith as one immediate attempt (a wire wait of
// 0: never queued), under the 5 s transport deadline (or ctx's, if
// sooner), as TryAcquire.
func (c *Client) TryAcquireWith(ctx context.Context, key string, places *Places, lease time.Duration) (*Ticket, error) {
	dl, _ := ctx.Deadline()
	return c.acquire(ctx, key, places, lease, transportPlan(time.Now(), dl))
}
