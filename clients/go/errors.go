package ticketd

import (
	"errors"
	"fmt"
)

// kind is a sentinel error that may belong to a wider one, so that
// errors.Is(ErrTimeout, ErrNotAcquired) holds.
type kind struct {
	msg    string
	parent error
}

func (k *kind) Error() string { return k.msg }

func (k *kind) Is(target error) bool { return k.parent != nil && errors.Is(k.parent, target) }

// The outcomes other than success, for errors.Is. Every acquire that does
// not return a ticket returns an error that is ErrNotAcquired: the caller
// must not enter its critical section.
var (
	// ErrNotAcquired: the lock is not held. ErrTimeout, ErrBusy,
	// ErrLimitMismatch and ErrIndeterminate are all ErrNotAcquired; so is an acquire whose
	// context was canceled before its request was sent.
	ErrNotAcquired = errors.New("ticketd: not acquired")
	// ErrTimeout: the key stayed held for the whole wait (a T reply), or
	// the request was never sent before the deadline (no server reached).
	// Definitely not acquired.
	ErrTimeout error = &kind{"ticketd: timeout", ErrNotAcquired}
	// ErrBusy: a server limit (a full queue, too many keys, a lease over
	// the server's --max-lease); not queued. Definitely not acquired.
	ErrBusy error = &kind{"ticketd: busy", ErrNotAcquired}
	// ErrLimitMismatch: (protocol 1.2, an acquire with places only) the
	// key is registered with another limit, which Error.Limit carries;
	// not queued, and never retried with another limit. Definitely not
	// acquired.
	ErrLimitMismatch error = &kind{"ticketd: limit mismatch", ErrNotAcquired}
	// ErrIndeterminate: the request may have reached the server and no
	// answer came in time (or a grant came too late and was given back).
	// The caller must not enter; a grant that may exist ends with its lease.
	// A release or an extend by token may end with it too.
	ErrIndeterminate error = &kind{"ticketd: indeterminate", ErrNotAcquired}
	// ErrNotHeld: a release or an extend by token changed nothing (N or X):
	// the lease had ended, or the token does not match.
	ErrNotHeld = errors.New("ticketd: not held")
	// ErrNotSent: a release found no server within its deadline and sent
	// nothing; the lock stays held until its lease ends.
	ErrNotSent = errors.New("ticketd: not sent")
	// ErrLost: a ticket's grant is gone (X), or its conservative expiry
	// passed before a renewal was answered. Stop using the token.
	ErrLost = errors.New("ticketd: lost")
	// ErrInvalid: a bad argument or setting; nothing was sent.
	ErrInvalid = errors.New("ticketd: invalid argument")
	// ErrClosed: the client was closed.
	ErrClosed = errors.New("ticketd: client closed")
)

// Error is what a call returns when it fails: Kind is one of the
// sentinels above (errors.Is matches it and its wider kinds), Cause an
// optional reason (a context's error, a connection failure) that errors.Is
// matches as well.
type Error struct {
	Op    string // "acquire", "release", "extend"
	Key   string
	Kind  error
	Cause error
	// Limit is the limit the key is registered with, when Kind is
	// ErrLimitMismatch (protocol 1.2); 0 otherwise.
	Limit uint16
}

func (e *Error) Error() string {
	s := fmt.Sprintf("%s %q: %v", e.Op, e.Key, e.Kind)
	if e.Limit != 0 {
		s += fmt.Sprintf(" (the key's limit is %d)", e.Limit)
	}
	if e.Cause != nil {
		s += ": " + e.Cause.Error()
	}
	return s
}

// Unwrap returns Kind.
func (e *Error) Unwrap() error { return e.Kind }

// Is matches Cause, so that errors.Is(err, context.Canceled) holds for a
// call ended by its context.
func (e *Error) Is(target error) bool { return e.Cause != nil && errors.Is(e.Cause, target) }

func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, a...)...)
}
