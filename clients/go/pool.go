package ticketd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"
)

const (
	firstBackoff = 10 * time.Millisecond
	maxBackoff   = 500 * time.Millisecond
)

// address is one place to connect to: a resolved TCP address or a unix
// socket path.
type address struct {
	network string // "tcp" or "unix"
	dial    string // ip:port, or the socket path
	text    string // as given
	host    string // the host as given: the TLS server name; "" for unix
}

// resolve turns "host:port", "[v6]:port" or "unix:/path" into addresses.
func resolve(text string) ([]address, error) {
	if strings.HasPrefix(text, "unix:") {
		path := strings.TrimPrefix(text, "unix:")
		if path == "" {
			return nil, invalid("server address %q has no socket path", text)
		}
		return []address{{network: "unix", dial: path, text: text}}, nil
	}
	host, portText, err := net.SplitHostPort(text)
	if err != nil || host == "" {
		return nil, invalid("server address %q is not host:port or unix:/path", text)
	}
	port, err := strconv.Atoi(portText)
	if err != nil || port <= 0 || port > 65535 {
		return nil, invalid("server address %q has no valid port", text)
	}
	ips, err := net.DefaultResolver.LookupHost(context.Background(), host)
	if err != nil || len(ips) == 0 {
		return nil, invalid("cannot resolve server address %q: %v", text, err)
	}
	var out []address
	seen := map[string]bool{}
	for _, ip := range ips {
		d := net.JoinHostPort(ip, portText)
		if !seen[d] {
			seen[d] = true
			out = append(out, address{network: "tcp", dial: d, text: text, host: host})
		}
	}
	return out, nil
}

// slot is one place in the pool: empty, being connected (ready is closed
// when that ends), or holding a session.
type slot struct {
	s     *session
	ready chan struct{}
}

// pool is up to size sessions over the addresses, filled lazily, one
// connection per slot, round-robin over the addresses. A dead session is
// dropped the next time anyone looks for one.
type pool struct {
	addrs          []address
	tls            *tls.Config
	connectTimeout time.Duration
	maxKeyBytes    int
	orphan         func(string, uint64)

	mu       sync.Mutex
	slots    []slot
	rr       int
	nextAddr int
	lastErr  error
	closed   bool
}

func (p *pool) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// live counts the open connections.
func (p *pool) live() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, sl := range p.slots {
		if sl.s != nil && !sl.s.isDead() {
			n++
		}
	}
	return n
}

// get returns a live session, connecting one if the slot whose turn it is
// is empty; nil once deadline passes with none found, ctx is canceled, or
// the pool is closed. Between failed connection rounds it backs off.
func (p *pool) get(ctx context.Context, deadline time.Time) *session {
	backoff := firstBackoff
	for {
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			return nil
		}
		s, i, wait := p.pick()
		if s != nil {
			return s
		}
		if wait != nil {
			if !sleepUntil(ctx, deadline, maxBackoff, wait) {
				return nil
			}
			continue
		}
		if i < 0 {
			return nil // closed
		}
		if s := p.fill(ctx, i, deadline); s != nil {
			return s
		}
		if !sleepUntil(ctx, deadline, backoff, nil) {
			return nil
		}
		if backoff *= 2; backoff > maxBackoff {
			backoff = maxBackoff
		}
	}
}

// pick looks at the slot whose turn it is: its live session; or its index,
// claimed for the caller to fill; or, while someone else connects it, any
// live session, else a channel to wait on. i is -1 when the pool is closed.
func (p *pool) pick() (s *session, i int, wait chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, -1, nil
	}
	for j := range p.slots {
		if sl := p.slots[j]; sl.s != nil && sl.s.isDead() {
			p.slots[j] = slot{}
		}
	}
	i = p.rr % len(p.slots)
	p.rr++
	sl := p.slots[i]
	switch {
	case sl.s != nil:
		return sl.s, i, nil
	case sl.ready != nil:
		if live := p.anyLiveLocked(); live != nil {
			return live, i, nil
		}
		return nil, i, sl.ready
	}
	p.slots[i] = slot{ready: make(chan struct{})}
	return nil, i, nil
}

func (p *pool) anyLiveLocked() *session {
	for _, sl := range p.slots {
		if sl.s != nil && !sl.s.isDead() {
			return sl.s
		}
	}
	return nil
}

// fill connects the claimed slot i: its new session, or any live one if
// no address answered, or nil.
func (p *pool) fill(ctx context.Context, i int, deadline time.Time) *session {
	s, err := p.connectAny(ctx, deadline)
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.slots[i].ready; r != nil {
		close(r)
	}
	p.slots[i] = slot{}
	if s != nil && p.closed {
		s.close("client closed")
		return nil
	}
	if s != nil {
		p.slots[i] = slot{s: s}
		return s
	}
	if err != nil {
		p.lastErr = err
	}
	return p.anyLiveLocked()
}

// connectAny tries every address once, from the next in rotation, each
// connect capped by the connect timeout and the deadline.
func (p *pool) connectAny(ctx context.Context, deadline time.Time) (*session, error) {
	p.mu.Lock()
	first := p.nextAddr
	p.nextAddr++
	p.mu.Unlock()
	var last error
	for k := range p.addrs {
		a := p.addrs[(first+k)%len(p.addrs)]
		limit := time.Now().Add(p.connectTimeout)
		if deadline.Before(limit) {
			limit = deadline
		}
		if !time.Now().Before(limit) {
			break
		}
		conn, err := p.dial(ctx, a, limit)
		if err == nil {
			return newSession(conn, a.text, p.maxKeyBytes, p.orphan), nil
		}
		last = fmt.Errorf("%s (%s): cannot connect: %w", a.text, a.dial, err)
		p.mu.Lock()
		p.lastErr = last // kept even if a later address answers
		p.mu.Unlock()
	}
	if last == nil {
		last = errors.New("the deadline passed before connecting")
	}
	return nil, last
}

// dial connects, and over TCP with TLS runs the handshake, before limit.
func (p *pool) dial(ctx context.Context, a address, limit time.Time) (net.Conn, error) {
	ctx, cancel := context.WithDeadline(ctx, limit)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, a.network, a.dial)
	if err != nil {
		return nil, err
	}
	if a.network != "tcp" || p.tls == nil {
		return conn, nil
	}
	cfg := p.tls
	if cfg.ServerName == "" {
		cfg = cfg.Clone()
		cfg.ServerName = a.host
	}
	tc := tls.Client(conn, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("TLS: %w", err)
	}
	return tc, nil
}

func (p *pool) lastError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lastErr
}

// close closes every session; later gets return nil.
func (p *pool) close() {
	p.mu.Lock()
	p.closed = true
	var open []*session
	for j := range p.slots {
		if s := p.slots[j].s; s != nil {
			open = append(open, s)
			p.slots[j] = slot{}
		}
	}
	p.mu.Unlock()
	for _, s := range open {
		s.close("client closed")
	}
}

// sleepUntil pauses for d (or until wake is closed), never past deadline;
// false if ctx was canceled or the deadline has passed.
func sleepUntil(ctx context.Context, deadline time.Time, d time.Duration, wake chan struct{}) bool {
	if left := time.Until(deadline); left < d {
		d = left
	}
	if d <= 0 {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-wake:
	case <-ctx.Done():
		return false
	}
	return true
}
