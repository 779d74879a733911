package ticketd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
)

const (
	// DefaultPoolSize is how many connections a client keeps by default.
	DefaultPoolSize = 2
	// MaxPoolSize is the largest pool accepted.
	MaxPoolSize = 64
	// DefaultConnectTimeout caps one connection attempt by default.
	DefaultConnectTimeout = time.Second
)

// Config configures a Client. Only Addrs is required.
type Config struct {
	// Addrs: "host:port" ("[::1]:7470" for IPv6) or "unix:/path"; with
	// several, connections rotate over them and skip those that fail.
	Addrs []string
	// PoolSize: connections shared by every goroutine, 1..64 (default 2).
	PoolSize int
	// ConnectTimeout caps one connection attempt, TLS handshake included
	// (default 1 s); no attempt runs past a call's deadline either.
	ConnectTimeout time.Duration
	// MaxKeyBytes: the server's --max-key-bytes (default 1024).
	MaxKeyBytes int
	// TLSCAFile turns TLS on for every TCP address: a PEM file of the CA
	// certificates to trust. Unix socket addresses stay plaintext.
	TLSCAFile string
	// TLSCertFile and TLSKeyFile (PEM) present a client certificate to a
	// server that requires one (ticketd --tls-client-ca).
	TLSCertFile, TLSKeyFile string
	// TLSServerName checks every server's certificate against this name
	// instead of each address's host.
	TLSServerName string
	// TLSConfig is a ready configuration, instead of the files above.
	TLSConfig *tls.Config
}

// Client is a handle on a small pool of connections to a ticketd server
// (or to the nodes of a cluster), safe for use by many goroutines: their
// requests are pipelined on the pool's connections and the replies matched
// by owner, or by token and key, in any order (PROTOCOL §1, §3).
type Client struct {
	pool        *pool
	maxKeyBytes int

	bgMu     sync.Mutex
	bgClosed bool
	bg       sync.WaitGroup
}

// New checks cfg, reads the TLS files and resolves the addresses.
// Connections open lazily, on the first call that needs one, so New fails
// only for a configuration error (errors.Is(err, ErrInvalid)).
func New(cfg Config) (*Client, error) {
	if len(cfg.Addrs) == 0 {
		return nil, invalid("no server address was given")
	}
	if cfg.PoolSize == 0 {
		cfg.PoolSize = DefaultPoolSize
	}
	if cfg.PoolSize < 1 || cfg.PoolSize > MaxPoolSize {
		return nil, invalid("pool size %d is not within 1..%d", cfg.PoolSize, MaxPoolSize)
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	if cfg.ConnectTimeout < 0 {
		return nil, invalid("connect timeout %v is negative", cfg.ConnectTimeout)
	}
	if cfg.MaxKeyBytes == 0 {
		cfg.MaxKeyBytes = DefaultMaxKeyBytes
	}
	if cfg.MaxKeyBytes < 1 || cfg.MaxKeyBytes > maxKeyBytesCeiling {
		return nil, invalid("max key bytes %d is not within 1..%d", cfg.MaxKeyBytes, maxKeyBytesCeiling)
	}
	tc, err := tlsConfig(cfg)
	if err != nil {
		return nil, err
	}
	var addrs []address
	for _, text := range cfg.Addrs {
		a, err := resolve(text)
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, a...)
	}
	c := &Client{maxKeyBytes: cfg.MaxKeyBytes}
	c.pool = &pool{
		addrs: addrs, tls: tc, connectTimeout: cfg.ConnectTimeout,
		maxKeyBytes: cfg.MaxKeyBytes, orphan: c.releaseInBackground,
		slots: make([]slot, cfg.PoolSize),
	}
	return c, nil
}

// Dial is New with one address and the defaults.
func Dial(addr string) (*Client, error) { return New(Config{Addrs: []string{addr}}) }

func tlsConfig(cfg Config) (*tls.Config, error) {
	if cfg.TLSConfig != nil {
		if cfg.TLSCAFile != "" || cfg.TLSCertFile != "" || cfg.TLSKeyFile != "" {
			return nil, invalid("give either TLSConfig or the TLS files, not both")
		}
		tc := cfg.TLSConfig.Clone()
		if cfg.TLSServerName != "" {
			tc.ServerName = cfg.TLSServerName
		}
		return tc, nil
	}
	if cfg.TLSCAFile == "" {
		if cfg.TLSCertFile != "" || cfg.TLSKeyFile != "" || cfg.TLSServerName != "" {
			return nil, invalid("a client certificate or a server name without a CA file (TLSCAFile)")
		}
		return nil, nil
	}
	if (cfg.TLSCertFile == "") != (cfg.TLSKeyFile == "") {
		return nil, invalid("TLSCertFile and TLSKeyFile go together")
	}
	pem, err := os.ReadFile(cfg.TLSCAFile)
	if err != nil {
		return nil, invalid("TLS settings: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, invalid("TLS settings: no PEM certificate in %s", cfg.TLSCAFile)
	}
	tc := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12, ServerName: cfg.TLSServerName}
	if cfg.TLSCertFile != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLSCertFile, cfg.TLSKeyFile)
		if err != nil {
			return nil, invalid("TLS settings: %v", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// LastConnectError is the last connection failure, if any: it explains an
// ErrTimeout that came from an unreachable server rather than a held key.
func (c *Client) LastConnectError() error { return c.pool.lastError() }

// Connections is how many connections are open, for diagnostics.
func (c *Client) Connections() int { return c.pool.live() }

// Close closes the connections and waits for the background releases.
// Later calls fail with ErrClosed; held locks end with their leases, and
// keep-alives report their tickets lost.
func (c *Client) Close() error {
	c.bgMu.Lock()
	c.bgClosed = true
	c.bgMu.Unlock()
	c.pool.close()
	c.bg.Wait()
	return nil
}

// Acquire asks for key, queued on the server for at most the time left
// until ctx's deadline (clamped to 255 s; no deadline means 255 s), for a
// grant that lives lease (whole seconds, 1s..255s). It returns the Ticket,
// or an error that is ErrNotAcquired: ErrTimeout, ErrBusy, ErrIndeterminate
// (do not enter: a grant that may exist ends with its lease), ErrInvalid,
// or the context's cancellation. It returns by the deadline plus 1 s (the
// server rounds the wait up to whole seconds).
func (c *Client) Acquire(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	return c.AcquireWith(ctx, key, nil, lease)
}

// TryAcquire makes one immediate attempt (a wire wait of 0: never queued),
// under the 5 s transport deadline (or ctx's, if sooner). A held key gives
// ErrTimeout at once.
func (c *Client) TryAcquire(ctx context.Context, key string, lease time.Duration) (*Ticket, error) {
	return c.TryAcquireWith(ctx, key, nil, lease)
}

func (c *Client) checkAcquire(key string, places *Places, lease time.Duration) error {
	if err := checkKey(key, c.maxKeyBytes); err != nil {
		return err
	}
	if err := places.check(); err != nil {
		return err
	}
	if _, err := leaseByte(lease); err != nil {
		return err
	}
	if c.pool.isClosed() {
		return ErrClosed
	}
	return nil
}

func (c *Client) acquire(ctx context.Context, key string, places *Places, lease time.Duration, p plan) (*Ticket, error) {
	if err := c.checkAcquire(key, places, lease); err != nil {
		return nil, err
	}
	lb, _ := leaseByte(lease)
	owner := nextOwner()
	fail := func(kind, cause error) (*Ticket, error) {
		return nil, &Error{Op: "acquire", Key: key, Kind: kind, Cause: cause}
	}
	// Tried again only while definitely unsent: same owner, same plan,
	// another session.
	cl, s, o, stopped := c.sendOnce(ctx, p, func() *call {
		cl := newCall(opAcquire, key, p)
		cl.owner, cl.lease, cl.places = owner, lb, places
		return cl
	})
	switch {
	case s == nil && canceled(ctx):
		return fail(ErrNotAcquired, ctx.Err())
	case s == nil:
		return fail(ErrTimeout, c.notReached())
	case o == notSent:
		return fail(ErrNotAcquired, ctx.Err())
	case o == lost && stopped:
		return fail(ErrIndeterminate, ctx.Err())
	case o == lost:
		return fail(ErrIndeterminate, s.failure())
	case cl.replyOp == opTimeout:
		return fail(ErrTimeout, nil)
	case cl.replyOp == opBusy:
		return fail(ErrBusy, nil)
	case cl.replyOp == opLimitMismatch:
		// Final: never retried with another limit.
		return nil, &Error{Op: "acquire", Key: key, Kind: ErrLimitMismatch, Limit: cl.replyLimit}
	case stopped:
		// Granted as the caller gave up: given back.
		c.releaseInBackground(key, cl.replyToken)
		return fail(ErrNotAcquired, ctx.Err())
	case time.Now().After(p.gate):
		// The handover gate: a grant seen after D is given back.
		c.releaseInBackground(key, cl.replyToken)
		return fail(ErrIndeterminate, errLateGrant)
	}
	return newTicket(c, key, cl.replyToken, lease, cl.writtenAt), nil
}

// sendOnce hands the call mk makes to a pooled session and waits for its
// outcome, trying again (a new call, same plan) only while the call was
// definitely not sent and ctx goes on: a request is sent at most once
// (PROTOCOL §3). s is nil when no session could be had by the plan's send
// deadline; o is notSent only when ctx ended first.
func (c *Client) sendOnce(ctx context.Context, p plan, mk func() *call) (cl *call, s *session, o int, stopped bool) {
	pause := newRetryPause(p.sendDeadline)
	for {
		if s = c.pool.get(ctx, p.sendDeadline); s == nil {
			return nil, nil, 0, false
		}
		cl = mk()
		if !s.submit(cl) {
			pause.wait(ctx)
			continue
		}
		if o, stopped = s.await(ctx, cl); o == notSent && !stopped {
			pause.wait(ctx)
			continue
		}
		return cl, s, o, stopped
	}
}

var errLateGrant = errors.New("the grant came after the deadline and was given back")

func canceled(ctx context.Context) bool { return errors.Is(ctx.Err(), context.Canceled) }

func (s *session) failure() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Errorf("%s: %s", s.addr, s.why)
}

func (c *Client) notReached() error {
	if err := c.pool.lastError(); err != nil {
		return fmt.Errorf("not sent: no server reached in time; last: %w", err)
	}
	return errors.New("not sent: no server reached in time")
}

// Release releases token on key, from any process (locks belong to
// tokens, not connections), under the 5 s transport deadline or ctx's.
// nil: released (the next waiter, if any, has the key); ErrNotHeld:
// nothing changed; ErrIndeterminate: it may or may not have taken effect;
// ErrNotSent: no server reached, nothing sent.
func (c *Client) Release(ctx context.Context, key string, token uint64) error {
	if err := checkKey(key, c.maxKeyBytes); err != nil {
		return err
	}
	return c.release(ctx, key, token)
}

func (c *Client) release(ctx context.Context, key string, token uint64) error {
	dl, _ := ctx.Deadline()
	p := transportPlan(time.Now(), dl)
	fail := func(kind, cause error) error {
		return &Error{Op: "release", Key: key, Kind: kind, Cause: cause}
	}
	cl, s, o, stopped := c.sendOnce(ctx, p, func() *call {
		cl := newCall(opRelease, key, p)
		cl.token = token
		return cl
	})
	switch {
	case s == nil && ctx.Err() != nil:
		return fail(ErrNotSent, ctx.Err())
	case s == nil && c.pool.isClosed():
		return fail(ErrNotSent, ErrClosed)
	case s == nil:
		return fail(ErrNotSent, c.notReached())
	case o == notSent:
		return fail(ErrNotSent, ctx.Err())
	case o == lost && stopped:
		return fail(ErrIndeterminate, ctx.Err())
	case o == lost:
		return fail(ErrIndeterminate, s.failure())
	case cl.replyOp == opRelease:
		return nil
	}
	return fail(ErrNotHeld, nil)
}

// releaseInBackground gives back a grant nobody waits for (a late grant,
// a grant for an abandoned call), within the 5 s transport deadline
// counted from now. It never blocks.
func (c *Client) releaseInBackground(key string, token uint64) {
	c.bgMu.Lock()
	defer c.bgMu.Unlock()
	if c.bgClosed {
		return
	}
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), TransportDeadline)
		defer cancel()
		_ = c.release(ctx, key, token)
	}()
}

// Extend extends the grant token of key to live lease from about now,
// from any process, with no ticket (and so no expiry) to keep; under the
// 5 s transport deadline, or ctx's (protocol 1.1). nil: extended (E);
// ErrNotHeld: X (gone, another token, or a cap); ErrIndeterminate: no reply
// in time. A ticket's holder calls Ticket.Extend instead.
func (c *Client) Extend(ctx context.Context, key string, token uint64, lease time.Duration) error {
	if err := checkKey(key, c.maxKeyBytes); err != nil {
		return err
	}
	lb, err := leaseByte(lease)
	if err != nil {
		return err
	}
	_, res := c.extendAttempts(ctx, key, token, lb, time.Now().Add(TransportDeadline))
	switch res {
	case extended:
		return nil
	case notExtended:
		return &Error{Op: "extend", Key: key, Kind: ErrNotHeld}
	case extendStopped:
		return &Error{Op: "extend", Key: key, Kind: ErrIndeterminate, Cause: ctx.Err()}
	}
	return &Error{Op: "extend", Key: key, Kind: ErrIndeterminate, Cause: errors.New("no reply in time")}
}

type extendResult int

const (
	extended      extendResult = iota
	notExtended                // X
	noAnswer                   // no E by until
	extendStopped              // ctx ended first
)

// extendAttempts sends the Extend until an E or X matches or until
// passes; it returns the write time of the attempt answered E. An attempt
// with no reply within the transport deadline is given up (its connection
// closed) and sent again elsewhere: applying it twice only moves the
// caller's own expiry (PROTOCOL §5.3). An E matched at or after until
// counts for nothing.
func (c *Client) extendAttempts(ctx context.Context, key string, token uint64, lease uint8, until time.Time) (time.Time, extendResult) {
	limit := until
	if dl, ok := ctx.Deadline(); ok && dl.Before(limit) {
		limit = dl
	}
	pause := newRetryPause(limit)
	for {
		now := time.Now()
		if ctx.Err() != nil || (!now.Before(limit) && limit.Before(until)) {
			return time.Time{}, extendStopped
		}
		if !now.Before(limit) || c.pool.isClosed() {
			return time.Time{}, noAnswer
		}
		p := transportPlan(now, limit)
		s := c.pool.get(ctx, p.sendDeadline)
		if s == nil {
			pause.wait(ctx)
			continue
		}
		cl := newCall(opExtend, key, p)
		cl.token, cl.lease = token, lease
		if s.submit(cl) {
			o, stopped := s.await(ctx, cl)
			if stopped {
				return time.Time{}, extendStopped
			}
			if o == answered && cl.replyOp == opNotExtended {
				return time.Time{}, notExtended
			}
			if o == answered && time.Now().Before(until) {
				return cl.writtenAt, extended
			}
		}
		// Not sent, sent into a connection that died, no reply in time,
		// or an E too late to count: the next round gives up or resends.
		pause.wait(ctx)
	}
}

// retryPause paces the retries of a call whose session died: the first
// at once, later ones 10 ms doubling to 500 ms, never past until.
type retryPause struct {
	next  time.Duration
	until time.Time
}

func newRetryPause(until time.Time) *retryPause { return &retryPause{until: until} }

func (r *retryPause) wait(ctx context.Context) {
	if r.next > 0 {
		sleepUntil(ctx, r.until, r.next, nil)
	}
	switch {
	case r.next == 0:
		r.next = firstBackoff
	case r.next < maxBackoff:
		r.next *= 2
		if r.next > maxBackoff {
			r.next = maxBackoff
		}
	}
}
