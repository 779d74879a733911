package ticketd

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// batchBytes caps one write: it bounds how many queued requests one stalled
// write turns from "unsent" into "may have been sent".
const batchBytes = 16 * 1024

// A call's phase.
const (
	queued = iota // in the session's queue: not one byte of it written
	sent          // may have been sent: never sent again
	done
)

// How a call ended.
const (
	answered = iota + 1 // a reply matched it
	notSent             // withdrawn before any byte reached a socket
	lost                // it may have been sent and no reply can come
)

// call is one request on one session.
type call struct {
	kind  byte // opAcquire, opRelease or opExtend
	key   string
	owner uint64
	token uint64
	lease uint8
	// places: an acquire with places (protocol 1.2), sent as P; nil for
	// a plain acquire, sent as A.
	places *Places
	plan   plan

	phase      int
	outcome    int
	writtenAt  time.Time
	replyOp    byte
	replyToken uint64
	// replyLimit is the key's limit an L carried (protocol 1.2).
	replyLimit uint16
	// abandoned: its caller stopped waiting (its context was canceled);
	// a grant that answers it is given back at once.
	abandoned bool
	done      chan struct{}
}

func newCall(kind byte, key string, p plan) *call {
	return &call{kind: kind, key: key, plan: p, done: make(chan struct{})}
}

func (c *call) finish(outcome int) {
	if c.phase != done {
		c.phase = done
		c.outcome = outcome
		close(c.done)
	}
}

type tokenKey struct {
	op    byte
	token uint64
}

// session is one connection: a writer goroutine, a reader goroutine, and
// the tables that match pipelined replies to their calls, A/T/B by owner
// and R/N, E/X by token and key, in any order. One mutex guards the queue,
// the tables and every call's phase, so "is it still queued?" has one
// answer for the writer, the reader and the waiting caller.
type session struct {
	conn        net.Conn
	addr        string
	maxKeyBytes int
	// orphan gives back a grant nobody waits for (never blocks).
	orphan func(key string, token uint64)

	mu       sync.Mutex
	wake     *sync.Cond
	dead     bool
	why      string
	queue    []*call
	acquires map[uint64]*call
	byToken  map[tokenKey][]*call
}

func newSession(conn net.Conn, addr string, maxKeyBytes int, orphan func(string, uint64)) *session {
	s := &session{
		conn: conn, addr: addr, maxKeyBytes: maxKeyBytes, orphan: orphan,
		acquires: make(map[uint64]*call),
		byToken:  make(map[tokenKey][]*call),
	}
	s.wake = sync.NewCond(&s.mu)
	go s.writeLoop()
	go s.readLoop()
	return s
}

func (s *session) isDead() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead
}

// submit queues c for the writer; false if the session is dead (c is
// untouched and can go elsewhere).
func (s *session) submit(c *call) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return false
	}
	s.queue = append(s.queue, c)
	s.wake.Signal()
	return true
}

// await waits for c (submitted here) to end under its plan: withdrawn
// unsent at its send deadline; given up, with this session closed, at its
// give-up instant if it may have been sent and has no reply. A canceled
// ctx withdraws c if it is still queued, else abandons it (a grant that
// answers it later is given back); canceled reports that. A ctx deadline
// is not a cancellation here: the plan already holds it, with its grace.
func (s *session) await(ctx context.Context, c *call) (outcome int, canceled bool) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	cancel := ctx.Done()
	for {
		s.mu.Lock()
		if o, ended := s.checkPlanLocked(c, time.Now()); ended {
			s.mu.Unlock()
			return o, false
		}
		limit := c.plan.sendDeadline
		if c.phase == sent {
			limit = c.plan.giveUp
		}
		s.mu.Unlock()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(time.Until(limit))
		select {
		case <-c.done:
		case <-timer.C:
		case <-cancel:
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				cancel = nil
				continue
			}
			return s.abandon(c), true
		}
	}
}

// abandon ends the wait for c, whose caller gave up.
func (s *session) abandon(c *call) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch c.phase {
	case done:
		return c.outcome
	case queued:
		s.removeQueuedLocked(c)
		c.finish(notSent)
		return notSent
	}
	c.abandoned = true
	// Its reply is still watched until its give-up instant (a grant that
	// answers it is given back); unanswered then, the session closes, as it
	// would under a waiting caller.
	time.AfterFunc(time.Until(c.plan.giveUp), func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if c.phase == sent {
			s.closeLocked("no reply by an abandoned call's deadline")
		}
	})
	return lost
}

// checkPlanLocked ends c if its plan says so at now.
func (s *session) checkPlanLocked(c *call, now time.Time) (int, bool) {
	if c.phase == done {
		return c.outcome, true
	}
	limit := c.plan.sendDeadline
	if c.phase == sent {
		limit = c.plan.giveUp
	}
	if now.Before(limit) {
		return 0, false
	}
	if c.phase == queued {
		s.removeQueuedLocked(c)
		c.finish(notSent)
		return notSent, true
	}
	// Sent and unanswered at the give-up instant: close exactly this
	// session. A later reply could not be told apart from a late one, and
	// the server must not keep a queued acquire for a caller that left.
	s.closeLocked("no reply by the call's deadline")
	return c.outcome, true
}

func (s *session) removeQueuedLocked(c *call) {
	for i, q := range s.queue {
		if q == c {
			s.queue = append(s.queue[:i], s.queue[i+1:]...)
			return
		}
	}
}

// close ends the session: queued calls end notSent (they may go
// elsewhere), calls that may have been sent end lost.
func (s *session) close(why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeLocked(why)
}

func (s *session) closeLocked(why string) {
	if s.dead {
		return
	}
	s.dead = true
	s.why = why
	for _, c := range s.queue {
		c.finish(notSent)
	}
	s.queue = nil
	for _, c := range s.acquires {
		c.finish(lost)
	}
	s.acquires = nil
	for _, cs := range s.byToken {
		for _, c := range cs {
			c.finish(lost)
		}
	}
	s.byToken = nil
	s.wake.Broadcast()
	// Wakes the reader, and a writer blocked on a full socket.
	_ = s.conn.Close()
}

func (s *session) writeLoop() {
	var buf []byte
	for {
		s.mu.Lock()
		for !s.dead && len(s.queue) == 0 {
			s.wake.Wait()
		}
		if s.dead {
			s.mu.Unlock()
			return
		}
		buf = s.takeBatchLocked(buf[:0], time.Now())
		s.mu.Unlock()
		if len(buf) == 0 {
			continue
		}
		if _, err := s.conn.Write(buf); err != nil {
			s.close("write failed: " + err.Error())
			return
		}
		if cap(buf) > 4*batchBytes {
			buf = nil
		}
	}
}

// takeBatchLocked encodes queued calls into buf, each with its wire wait
// computed now, just before the write, and marks them sent before a byte
// of them leaves. A call past its send deadline is dropped unsent.
func (s *session) takeBatchLocked(buf []byte, now time.Time) []byte {
	n := 0
	for n < len(s.queue) && len(buf) < batchBytes {
		c := s.queue[n]
		n++
		wait, ok := c.plan.wireWait(now)
		if !ok {
			c.finish(notSent)
			continue
		}
		switch c.kind {
		case opAcquire:
			if c.places != nil {
				buf = appendAcquireWithLimit(buf, wait, c.lease, c.owner, *c.places, c.key)
			} else {
				buf = appendAcquire(buf, wait, c.lease, c.owner, c.key)
			}
			if old := s.acquires[c.owner]; old != nil {
				// Owners are fresh per call; were one ever to repeat,
				// the older call could no longer be told apart.
				old.finish(lost)
			}
			s.acquires[c.owner] = c
		case opRelease:
			buf = appendRelease(buf, c.token, c.key)
			k := tokenKey{opRelease, c.token}
			s.byToken[k] = append(s.byToken[k], c)
		default:
			buf = appendExtend(buf, c.lease, c.token, c.key)
			k := tokenKey{opExtend, c.token}
			s.byToken[k] = append(s.byToken[k], c)
		}
		c.phase = sent
		c.writtenAt = now
	}
	rest := copy(s.queue, s.queue[n:])
	for i := rest; i < len(s.queue); i++ {
		s.queue[i] = nil
	}
	s.queue = s.queue[:rest]
	return buf
}

func (s *session) readLoop() {
	chunk := make([]byte, 64*1024)
	var buf []byte
	for {
		n, err := s.conn.Read(chunk)
		if n > 0 {
			buf = append(buf, chunk[:n]...)
			used, why := s.consume(buf)
			buf = buf[:copy(buf, buf[used:])]
			if why != "" {
				s.close(why)
				return
			}
		}
		if err != nil {
			why := "read failed: " + err.Error()
			if errors.Is(err, net.ErrClosed) {
				why = "closed"
			} else if errors.Is(err, io.EOF) {
				why = "connection closed by the server"
			}
			s.close(why)
			return
		}
	}
}

// consume decodes and delivers every whole reply in buf, under one taking
// of the lock; it returns the bytes used and why the session must close.
// What stays is at most one incomplete, maximal reply.
func (s *session) consume(buf []byte) (int, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pos := 0
	for {
		r, used, err := decodeReply(buf[pos:], s.maxKeyBytes)
		if err == errNeedMore {
			return pos, ""
		}
		if err != nil {
			return pos, "malformed reply from the server: " + err.Error()
		}
		pos += used
		if s.dead {
			continue
		}
		if why := s.deliverLocked(r); why != "" {
			return pos, why
		}
	}
}

// deliverLocked hands r to its call; it returns why the session must
// close, or "".
func (s *session) deliverLocked(r reply) string {
	switch r.op {
	case opAcquire, opTimeout, opBusy, opLimitMismatch:
		owner := r.a
		if r.op == opAcquire {
			owner = r.owner
		}
		c := s.acquires[owner]
		if c == nil {
			if r.op == opAcquire {
				// A grant nobody waits for: given back at once rather
				// than left held for a lease.
				s.orphan(r.key, r.a)
			}
			return ""
		}
		delete(s.acquires, owner)
		if c.key != r.key {
			c.finish(lost)
			return "reply key does not match the request"
		}
		if r.op == opLimitMismatch && c.places == nil {
			// An L answers only an Acquire With Limit: a server that
			// sends one for an A cannot be trusted with this call.
			c.finish(lost)
			return "LimitMismatch reply to a plain acquire"
		}
		c.replyOp, c.replyToken, c.replyLimit = r.op, r.a, r.limit
		c.finish(answered)
		if c.abandoned && r.op == opAcquire {
			s.orphan(r.key, r.a)
		}
		return ""
	}
	op := byte(opRelease)
	if r.op == opExtend || r.op == opNotExtended {
		op = opExtend
	}
	k := tokenKey{op, r.a}
	cs := s.byToken[k]
	for i, c := range cs {
		if c.key == r.key {
			cs = append(cs[:i], cs[i+1:]...)
			if len(cs) == 0 {
				delete(s.byToken, k)
			} else {
				s.byToken[k] = cs
			}
			c.replyOp, c.replyToken = r.op, r.a
			c.finish(answered)
			break
		}
	}
	return ""
}
