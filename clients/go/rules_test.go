package ticketd

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestAcquireExtendReleaseAgainstTheServer(t *testing.T) {
	s := startServer(t)
	c, other := dial(t, s.Addr), dial(t, s.Addr)
	tk := mustAcquire(t, c, "db-migration", 2*time.Second)
	if tk.Token() == 0 || tk.Key() != "db-migration" || tk.Remaining() <= time.Second {
		t.Fatalf("ticket %d %q %v", tk.Token(), tk.Key(), tk.Remaining())
	}
	if !holds(t, other, "db-migration") {
		t.Fatal("the server does not hold the key")
	}
	before := tk.ExpiresAt()
	if err := tk.Extend(within(5*time.Second), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if moved := tk.ExpiresAt().Sub(before); moved < 7*time.Second {
		t.Fatalf("expiry moved by %v", moved)
	}
	if err := tk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if holds(t, other, "db-migration") {
		t.Fatal("released, still held")
	}
	err := c.Release(context.Background(), "db-migration", tk.Token())
	if !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second release: %v", err)
	}
	// Tokens only grow.
	tk2 := mustAcquire(t, c, "db-migration", 2*time.Second)
	if tk2.Token() <= tk.Token() {
		t.Fatalf("token %d after %d", tk2.Token(), tk.Token())
	}
	// An extend of a released grant is X: lost.
	_ = tk2.Release(context.Background())
	tk3 := mustAcquire(t, c, "other", 5*time.Second)
	if err := other.Release(context.Background(), "other", tk3.Token()); err != nil {
		t.Fatal(err)
	}
	if err := tk3.Extend(within(5*time.Second), 0); !errors.Is(err, ErrLost) {
		t.Fatalf("extend after a release by token: %v", err)
	}
	select {
	case <-tk3.Lost():
	default:
		t.Fatal("Lost not closed after an X")
	}
	if err := c.Extend(context.Background(), "other", tk3.Token(), 5*time.Second); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("extend by token: %v", err)
	}
}

func TestAHeldKeyTimesOutAtTheDeadline(t *testing.T) {
	s := startServer(t)
	c := dial(t, s.Addr)
	tk := mustAcquire(t, c, "k", 30*time.Second)
	defer func() { _ = tk.Release(context.Background()) }()
	start := time.Now()
	_, err := c.Acquire(within(time.Second), "k", 5*time.Second)
	took := time.Since(start)
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, ErrNotAcquired) || errors.Is(err, ErrIndeterminate) {
		t.Fatalf("err %v", err)
	}
	if took < 900*time.Millisecond || took > 2500*time.Millisecond {
		t.Fatalf("took %v", took)
	}
	start = time.Now()
	if _, err := c.TryAcquire(context.Background(), "k", 5*time.Second); !errors.Is(err, ErrTimeout) {
		t.Fatalf("try: %v", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("a wait-0 attempt took %v", took)
	}
	// A deadline already past sends nothing.
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if _, err := c.Acquire(ctx, "free", time.Second); !errors.Is(err, ErrTimeout) {
		t.Fatalf("past deadline: %v", err)
	}
	if holds(t, c, "free") {
		t.Fatal("an acquire past its deadline was sent")
	}
}

func TestALimitAnswersBusy(t *testing.T) {
	s := startServer(t, "--max-lease", "10", "--max-waiters-per-key", "1")
	c := dial(t, s.Addr)
	if _, err := c.Acquire(within(2*time.Second), "k", 20*time.Second); !errors.Is(err, ErrBusy) || !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("lease over the cap: %v", err)
	}
	tk := mustAcquire(t, c, "k", 10*time.Second)
	defer func() { _ = tk.Release(context.Background()) }()
	queued := make(chan error, 1)
	go func() {
		_, err := c.Acquire(within(3*time.Second), "k", 5*time.Second)
		queued <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if _, err := c.Acquire(within(3*time.Second), "k", 5*time.Second); !errors.Is(err, ErrBusy) {
		t.Fatalf("second waiter: %v", err)
	}
	if err := <-queued; !errors.Is(err, ErrTimeout) {
		t.Fatalf("first waiter: %v", err)
	}
}

func TestNoAnswerIsIndeterminateAndClosesTheConnection(t *testing.T) {
	f := startFake(t, nil) // reads, never answers
	c := dial(t, f.addr())
	start := time.Now()
	_, err := c.Acquire(within(time.Second), "k", 5*time.Second)
	took := time.Since(start)
	if !errors.Is(err, ErrIndeterminate) || !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("err %v", err)
	}
	// Given up at D + 1 s, not before.
	if took < 1900*time.Millisecond || took > 3*time.Second {
		t.Fatalf("took %v", took)
	}
	r := f.next(t)
	if r.op != opAcquire || r.wait != 1 || r.lease != 5 || r.key != "k" {
		t.Fatalf("request %+v", r)
	}
	select {
	case <-f.closed:
	case <-time.After(2 * time.Second):
		t.Fatal("the client kept the connection")
	}
	select {
	case r := <-f.requests:
		t.Fatalf("sent again: %+v", r)
	default:
	}
}

func TestAKilledServerMakesASentAcquireIndeterminate(t *testing.T) {
	s := startServer(t)
	holder, c := dial(t, s.Addr), dial(t, s.Addr)
	mustAcquire(t, holder, "k", 30*time.Second)
	go func() {
		time.Sleep(300 * time.Millisecond)
		s.Kill()
	}()
	start := time.Now()
	_, err := c.Acquire(within(10*time.Second), "k", 5*time.Second)
	if !errors.Is(err, ErrIndeterminate) {
		t.Fatalf("err %v", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("took %v: the connection's end was not noticed", took)
	}
}

func TestNoServerIsATimeoutWithTheReason(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	c := dial(t, addr)
	start := time.Now()
	_, err = c.Acquire(within(700*time.Millisecond), "k", 5*time.Second)
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("err %v", err)
	}
	if took := time.Since(start); took > 1500*time.Millisecond {
		t.Fatalf("took %v", took)
	}
	if e := c.LastConnectError(); e == nil || !strings.Contains(e.Error(), "refused") {
		t.Fatalf("last connect error %v", e)
	}
	if err := c.Release(within(300*time.Millisecond), "k", 1); !errors.Is(err, ErrNotSent) {
		t.Fatalf("release: %v", err)
	}
}

func TestALateGrantIsGivenBack(t *testing.T) {
	released := make(chan request, 1)
	f := startFake(t, func(conn net.Conn, r request) {
		switch r.op {
		case opAcquire:
			// Answer after D (1 s) but before D + 1 s.
			time.Sleep(1300 * time.Millisecond)
			_, _ = conn.Write(append(appendRelease(nil, 77, r.key)[:0:0],
				append([]byte{opAcquire, 0, 0, 0, 0, 0, 0, 0, 77}, ownerBytes(r.id, r.key)...)...))
		case opRelease:
			released <- r
			_, _ = conn.Write(appendRelease(nil, r.id, r.key))
		}
	})
	c := dial(t, f.addr())
	_, err := c.Acquire(within(time.Second), "late", 5*time.Second)
	if !errors.Is(err, ErrIndeterminate) || !errors.Is(err, errLateGrant) {
		t.Fatalf("err %v", err)
	}
	select {
	case r := <-released:
		if r.id != 77 || r.key != "late" {
			t.Fatalf("released %+v", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the late grant was not given back")
	}
}

func ownerBytes(owner uint64, key string) []byte {
	b := make([]byte, 0, 9+len(key))
	for i := 7; i >= 0; i-- {
		b = append(b, byte(owner>>(8*i)))
	}
	return append(append(b, key...), '\n')
}

func TestACanceledWaiterGivesItsGrantBack(t *testing.T) {
	s := startServer(t)
	holder, c, probe := dial(t, s.Addr), dial(t, s.Addr), dial(t, s.Addr)
	tk := mustAcquire(t, holder, "k", 30*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan error, 1)
	go func() {
		_, err := c.Acquire(ctx, "k", 30*time.Second)
		got <- err
	}()
	time.Sleep(300 * time.Millisecond)
	cancel()
	err := <-got
	if !errors.Is(err, ErrNotAcquired) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
	// The holder leaves; the server hands the key to the abandoned
	// acquire, whose grant the client gives back at once.
	if err := tk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for holds(t, probe, "k") {
		if time.Now().After(deadline) {
			t.Fatal("the grant of a canceled acquire was kept")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestAnExpiredTicketIsLostWithoutSending(t *testing.T) {
	s := startServer(t)
	c := dial(t, s.Addr)
	tk := mustAcquire(t, c, "k", time.Second)
	time.Sleep(1100 * time.Millisecond)
	if !tk.IsLost() {
		t.Fatal("not lost past its expiry")
	}
	start := time.Now()
	if err := tk.Extend(context.Background(), 5*time.Second); !errors.Is(err, ErrLost) {
		t.Fatalf("err %v", err)
	}
	if time.Since(start) > 50*time.Millisecond {
		t.Fatal("an expired ticket's extend waited")
	}
	// A shorter extend shortens at once.
	tk2 := mustAcquire(t, c, "k2", 30*time.Second)
	if err := tk2.Extend(within(5*time.Second), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if r := tk2.Remaining(); r > 2*time.Second {
		t.Fatalf("remaining %v after an extend to 2 s", r)
	}
}

func TestKeepAliveHoldsPastTheLeaseAndReleases(t *testing.T) {
	s := startServer(t)
	c, other := dial(t, s.Addr), dial(t, s.Addr)
	tk, err := c.Lock(within(5*time.Second), "backup", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	if !holds(t, other, "backup") || tk.IsLost() {
		t.Fatal("the keep-alive did not hold the lock past its lease")
	}
	if err := tk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if holds(t, other, "backup") {
		t.Fatal("still held after Release")
	}
}

func TestKeepAliveSignalsLossOnX(t *testing.T) {
	s := startServer(t)
	c, other := dial(t, s.Addr), dial(t, s.Addr)
	tk := mustAcquire(t, c, "k", 3*time.Second)
	if err := tk.KeepAlive(300 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := other.Release(context.Background(), "k", tk.Token()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-tk.Lost():
	case <-time.After(2 * time.Second):
		t.Fatal("no loss signalled after the grant ended")
	}
	tk.StopRenewing()
}

func TestKeepAliveSignalsLossBeforeExpiryWhenTheServerDies(t *testing.T) {
	s := startServer(t)
	c := dial(t, s.Addr)
	tk, err := c.Lock(within(5*time.Second), "k", 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	s.Kill()
	select {
	case <-tk.Lost():
		if !time.Now().Before(tk.ExpiresAt()) {
			t.Fatal("loss signalled only at the expiry")
		}
	case <-time.After(4 * time.Second):
		t.Fatal("no loss signalled")
	}
	if err := tk.Release(within(500 * time.Millisecond)); err == nil {
		t.Fatal("released on a dead server")
	}
}

func TestAUnixSocketServesAndAMissingOneSaysWhy(t *testing.T) {
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "t.sock")
	startServer(t, "--listen", "unix:"+sock)
	c := dial(t, "unix:"+sock)
	tk := mustAcquire(t, c, "u", 5*time.Second)
	if err := tk.Extend(within(5*time.Second), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := tk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	missing := dial(t, "unix:"+filepath.Join(dir, "missing.sock"))
	if _, err := missing.Acquire(within(300*time.Millisecond), "u", time.Second); !errors.Is(err, ErrTimeout) {
		t.Fatalf("err %v", err)
	}
	if e := missing.LastConnectError(); e == nil || !strings.Contains(e.Error(), "missing.sock") {
		t.Fatalf("last connect error %v", e)
	}
}

func TestAddressesRotatePastADeadOne(t *testing.T) {
	s := startServer(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close()
	c := newClient(t, Config{Addrs: []string{dead, s.Addr}, PoolSize: 1})
	for i := 0; i < 3; i++ {
		tk := mustAcquire(t, c, "k", 5*time.Second)
		if err := tk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// Sixteen goroutines share two connections: one key contended, sections
// never overlap and tokens increase in grant order; other keys pipelined
// in between.
func TestManyGoroutinesShareThePool(t *testing.T) {
	s := startServer(t)
	c := newClient(t, Config{Addrs: []string{s.Addr}, PoolSize: 2})
	var (
		mu       sync.Mutex
		inside   bool
		tokens   []uint64
		problems []string
		wg       sync.WaitGroup
	)
	fail := func(p string) {
		mu.Lock()
		problems = append(problems, p)
		mu.Unlock()
	}
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 40; i++ {
				key := "shared"
				if i%2 == 1 {
					key = "own-" + string(rune('a'+g))
				}
				tk, err := c.Acquire(within(10*time.Second), key, 10*time.Second)
				if err != nil {
					fail(key + ": " + err.Error())
					continue
				}
				if key == "shared" {
					mu.Lock()
					if inside {
						problems = append(problems, "two holders")
					}
					inside = true
					tokens = append(tokens, tk.Token())
					inside = false
					mu.Unlock()
				}
				if err := tk.Release(context.Background()); err != nil {
					fail(key + ": release: " + err.Error())
				}
			}
		}(g)
	}
	wg.Wait()
	if len(problems) > 0 {
		t.Fatal(problems)
	}
	if len(tokens) != 16*20 {
		t.Fatalf("%d grants", len(tokens))
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Fatalf("token %d after %d", tokens[i], tokens[i-1])
		}
	}
	if n := c.Connections(); n > 2 {
		t.Fatalf("%d connections", n)
	}
}

func TestAClosedClientRefusesCalls(t *testing.T) {
	s := startServer(t)
	c, err := Dial(s.Addr)
	if err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, c, "k", time.Second)
	_ = c.Close()
	if _, err := c.Acquire(within(time.Second), "k", time.Second); !errors.Is(err, ErrClosed) {
		t.Fatalf("err %v", err)
	}
}
