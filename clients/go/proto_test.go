package ticketd

import (
	"bytes"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// PROTOCOL §1's worked example, and §5.1's.
func TestFramesMatchTheWorkedExamples(t *testing.T) {
	if got, want := appendAcquire(nil, 5, 30, 0x0A0B, "db"), unhex(t, "41 05 1E 00 00 00 00 00 00 0A 0B 64 62 0A"); !bytes.Equal(got, want) {
		t.Fatalf("acquire % x, want % x", got, want)
	}
	if got, want := appendRelease(nil, 1, "db"), unhex(t, "52 00 00 00 00 00 00 00 01 64 62 0A"); !bytes.Equal(got, want) {
		t.Fatalf("release % x, want % x", got, want)
	}
	if got, want := appendExtend(nil, 30, 7, "db"), unhex(t, "45 1E 00 00 00 00 00 00 00 07 64 62 0A"); !bytes.Equal(got, want) {
		t.Fatalf("extend % x, want % x", got, want)
	}
	stream := unhex(t, "41 00 00 00 00 00 00 00 01 00 00 00 00 00 00 0A 0B 64 62 0A"+
		"54 00 00 00 00 00 00 0A 0B 64 62 0A"+"58 00 00 00 00 00 00 00 07 64 62 0A")
	want := []reply{{opAcquire, 1, 0x0A0B, "db", 0}, {opTimeout, 0x0A0B, 0, "db", 0}, {opNotExtended, 7, 0, "db", 0}}
	for _, w := range want {
		r, used, err := decodeReply(stream, 1024)
		if err != nil || r != w {
			t.Fatalf("decoded %+v %v, want %+v", r, err, w)
		}
		stream = stream[used:]
	}
	if len(stream) != 0 {
		t.Fatalf("%d bytes left", len(stream))
	}
}

func TestDecodingWaitsForTheHeaderAndBoundsTheKey(t *testing.T) {
	full := unhex(t, "41 00 00 00 00 00 00 00 01 00 00 00 00 00 00 0A 0B 64 62 0A")
	for i := 0; i < len(full); i++ {
		if _, _, err := decodeReply(full[:i], 1024); err != errNeedMore {
			t.Fatalf("prefix of %d bytes: %v", i, err)
		}
	}
	long := append(unhex(t, "52 00 00 00 00 00 00 00 01"), bytes.Repeat([]byte("k"), 5)...)
	if _, _, err := decodeReply(long, 4); err == nil || err == errNeedMore {
		t.Fatalf("a key over the limit: %v", err)
	}
	for _, bad := range []string{"5a 00", "52 00 00 00 00 00 00 00 01 0a", "52 00 00 00 00 00 00 00 01 ff 0a"} {
		if _, _, err := decodeReply(unhex(t, bad), 1024); err == nil || err == errNeedMore {
			t.Fatalf("%s: %v", bad, err)
		}
	}
}

func TestWireWaitRoundsUpAndPlansKeepOneDeadline(t *testing.T) {
	now := time.Now()
	p := acquirePlan(now, 5*time.Second)
	if w, ok := p.wireWait(now.Add(2100 * time.Millisecond)); !ok || w != 3 {
		t.Fatalf("wire wait %d %v, want 3", w, ok)
	}
	if _, ok := p.wireWait(now.Add(5 * time.Second)); ok {
		t.Fatal("sent at D")
	}
	if !p.giveUp.Equal(now.Add(6 * time.Second)) {
		t.Fatal("give-up is not D + 1 s")
	}
	if w, ok := acquirePlan(now, 300*time.Second).wireWait(now); !ok || w != 255 {
		t.Fatalf("long wait: %d", w)
	}
	if w, ok := transportPlan(now, time.Time{}).wireWait(now); !ok || w != 0 {
		t.Fatalf("wait-0: %d", w)
	}
}

func TestOwnersAreFresh(t *testing.T) {
	seen := map[uint64]bool{}
	for i := 0; i < 10000; i++ {
		o := nextOwner()
		if seen[o] {
			t.Fatal("owner repeated")
		}
		seen[o] = true
	}
}

func TestBadArgumentsAreRefusedBeforeAnythingIsSent(t *testing.T) {
	f := startFake(t, nil)
	c := dial(t, f.addr())
	ctx := within(time.Second)
	for _, key := range []string{"", "a\nb", "\xff", strings.Repeat("k", 1025)} {
		if _, err := c.Acquire(ctx, key, time.Second); !errors.Is(err, ErrInvalid) {
			t.Fatalf("key %q: %v", key, err)
		}
	}
	for _, lease := range []time.Duration{0, 1500 * time.Millisecond, 256 * time.Second, -time.Second} {
		if _, err := c.Acquire(ctx, "k", lease); !errors.Is(err, ErrInvalid) {
			t.Fatalf("lease %v: %v", lease, err)
		}
	}
	if err := c.Release(ctx, "", 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("release: %v", err)
	}
	if c.Connections() != 0 {
		t.Fatal("a connection was opened for a bad argument")
	}
	for _, cfg := range []Config{
		{}, {Addrs: []string{"localhost"}}, {Addrs: []string{"127.0.0.1:0"}}, {Addrs: []string{"unix:"}},
		{Addrs: []string{"127.0.0.1:1"}, PoolSize: 65},
		{Addrs: []string{"127.0.0.1:1"}, TLSServerName: "x"},
		{Addrs: []string{"127.0.0.1:1"}, TLSCAFile: "/nonexistent/ca.pem"},
	} {
		if _, err := New(cfg); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%+v: %v", cfg, err)
		}
	}
}
