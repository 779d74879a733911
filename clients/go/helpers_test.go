package ticketd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/ticketd/ticketd/clients/go/internal/ticketdproc"
)

// startServer runs the real ticketd (port 0) for the test.
func startServer(t *testing.T, args ...string) *ticketdproc.Server {
	t.Helper()
	bin, err := ticketdproc.Binary()
	if err != nil {
		t.Fatal(err)
	}
	s, err := ticketdproc.Start(bin, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

func newClient(t *testing.T, cfg Config) *Client {
	t.Helper()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func dial(t *testing.T, addr string) *Client {
	return newClient(t, Config{Addrs: []string{addr}})
}

func within(d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	_ = cancel // ends with its deadline
	return ctx
}

func mustAcquire(t *testing.T, c *Client, key string, lease time.Duration) *Ticket {
	t.Helper()
	tk, err := c.Acquire(within(5*time.Second), key, lease)
	if err != nil {
		t.Fatalf("acquire %q: %v (last connect error: %v)", key, err, c.LastConnectError())
	}
	return tk
}

// holds reports whether the server holds key: a wait-0 acquire is
// answered T (a grant instead is given back at once).
func holds(t *testing.T, c *Client, key string) bool {
	t.Helper()
	tk, err := c.TryAcquire(context.Background(), key, time.Second)
	if err == nil {
		if err := tk.Release(context.Background()); err != nil {
			t.Fatalf("release of a probe: %v", err)
		}
		return false
	}
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("probe of %q: %v", key, err)
	}
	return true
}

func shortTempDir(t *testing.T) string {
	t.Helper()
	// Short: a unix socket path is limited to about 100 bytes.
	d, err := os.MkdirTemp("", "tkg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// request is one decoded request frame, for the fake servers.
type request struct {
	op    byte
	wait  uint8
	lease uint8
	id    uint64 // owner (A, P) or token (R, E)
	key   string
	// places: the limit and mode of a P (protocol 1.2).
	places Places
}

func readRequest(br *bufio.Reader) (request, error) {
	op, err := br.ReadByte()
	if err != nil {
		return request{}, err
	}
	var head []byte
	switch op {
	case opAcquire:
		head = make([]byte, 10)
	case opRelease:
		head = make([]byte, 8)
	case opExtend:
		head = make([]byte, 9)
	case opAcquireWithLimit:
		head = make([]byte, 13)
	default:
		return request{}, errors.New("unknown op")
	}
	if _, err := io.ReadFull(br, head); err != nil {
		return request{}, err
	}
	key, err := br.ReadString('\n')
	if err != nil {
		return request{}, err
	}
	r := request{op: op, key: key[:len(key)-1]}
	switch op {
	case opAcquire:
		r.wait, r.lease, r.id = head[0], head[1], binary.BigEndian.Uint64(head[2:])
	case opAcquireWithLimit:
		r.wait, r.lease, r.id = head[0], head[1], binary.BigEndian.Uint64(head[2:10])
		r.places = Places{Limit: binary.BigEndian.Uint16(head[10:12]), Mode: Mode(head[12])}
	case opRelease:
		r.id = binary.BigEndian.Uint64(head)
	default:
		r.lease, r.id = head[0], binary.BigEndian.Uint64(head[1:])
	}
	return r, nil
}

// fakeServer accepts connections and hands each request to handle; each
// connection's end is reported on closed.
type fakeServer struct {
	ln       net.Listener
	requests chan request
	closed   chan struct{}
}

func startFake(t *testing.T, handle func(conn net.Conn, r request)) *fakeServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeServer{ln: ln, requests: make(chan request, 100), closed: make(chan struct{}, 100)}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = conn.Close() })
			go func() {
				br := bufio.NewReader(conn)
				for {
					r, err := readRequest(br)
					if err != nil {
						f.closed <- struct{}{}
						return
					}
					f.requests <- r
					if handle != nil {
						handle(conn, r)
					}
				}
			}()
		}
	}()
	return f
}

func (f *fakeServer) addr() string { return f.ln.Addr().String() }

func (f *fakeServer) next(t *testing.T) request {
	t.Helper()
	select {
	case r := <-f.requests:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("the fake server received no request")
	}
	return request{}
}
