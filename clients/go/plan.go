package ticketd

import (
	"time"
	"unicode/utf8"
)

const (
	// MaxWait is the longest wait the wire carries; longer waits (and a
	// context without a deadline) are clamped to it.
	MaxWait = 255 * time.Second
	// MaxLease is the longest lease the wire carries.
	MaxLease = 255 * time.Second
	// TransportDeadline bounds a wait-0 acquire, a release and each extend
	// attempt (PROTOCOL §3).
	TransportDeadline = 5 * time.Second
	// responseGrace is how long past D a reply is still waited for: the
	// wire wait was rounded up, so the server may answer a second after D.
	responseGrace = time.Second
	// DefaultMaxKeyBytes is the server's default --max-key-bytes.
	DefaultMaxKeyBytes = 1024
	maxKeyBytesCeiling = 65536
)

// plan holds every instant that governs one call (PROTOCOL §3, §5.3).
type plan struct {
	// waitDeadline is D of an acquire with a wait above 0; zero for a
	// wait-0 acquire, a release or an extend, which carry no wait.
	waitDeadline time.Time
	// sendDeadline: written only before it; still queued then, dropped unsent.
	sendDeadline time.Time
	// gate: an A seen by the caller after it is not handed over.
	gate time.Time
	// giveUp: possibly sent and unanswered at this instant, given up.
	giveUp time.Time
}

// wireWait is the wait byte to write at now; ok is false when the request
// must not be sent any more.
func (p plan) wireWait(now time.Time) (wait uint8, ok bool) {
	if !now.Before(p.sendDeadline) {
		return 0, false
	}
	if p.waitDeadline.IsZero() {
		return 0, true
	}
	return wireWaitFor(p.waitDeadline.Sub(now))
}

// wireWaitFor rounds remaining up to whole seconds, at most 255.
func wireWaitFor(remaining time.Duration) (uint8, bool) {
	if remaining <= 0 {
		return 0, false
	}
	s := (remaining + time.Second - 1) / time.Second
	if s > 255 {
		s = 255
	}
	return uint8(s), true
}

// acquirePlan: D = start + wait (wait already clamped to 0..MaxWait).
func acquirePlan(start time.Time, wait time.Duration) plan {
	if wait <= 0 {
		return transportPlan(start, time.Time{})
	}
	d := start.Add(wait)
	return plan{waitDeadline: d, sendDeadline: d, gate: d, giveUp: d.Add(responseGrace)}
}

// transportPlan: a release, or a wait-0 acquire, started at start, never
// past limit (zero: no limit).
func transportPlan(start time.Time, limit time.Time) plan {
	t := start.Add(TransportDeadline)
	if !limit.IsZero() && limit.Before(t) {
		t = limit
	}
	return plan{sendDeadline: t, gate: t, giveUp: t}
}

func checkKey(key string, maxKeyBytes int) error {
	switch {
	case key == "":
		return invalid("the key is empty")
	case !utf8.ValidString(key):
		return invalid("the key is not valid UTF-8")
	case len(key) > maxKeyBytes:
		return invalid("the key is %d bytes long, the limit is %d", len(key), maxKeyBytes)
	}
	for i := 0; i < len(key); i++ {
		if key[i] == '\n' {
			return invalid("the key contains a newline")
		}
	}
	return nil
}

// leaseByte checks a lease: whole seconds in 1..=255, never rounded.
func leaseByte(lease time.Duration) (uint8, error) {
	if lease < time.Second || lease > MaxLease {
		return 0, invalid("a lease of %v is not allowed: it must be 1s..255s", lease)
	}
	if lease%time.Second != 0 {
		return 0, invalid("a lease of %v is not a whole number of seconds", lease)
	}
	return uint8(lease / time.Second), nil
}
