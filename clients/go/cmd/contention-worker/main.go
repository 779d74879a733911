// Command contention-worker is the Go worker of the cross-language
// contention test (tests/client/languages.rs):
//
//	contention-worker ADDR KEY CYCLES COUNTER_FILE
//
// Each cycle acquires KEY (wait 30 s, lease 30 s), reads COUNTER_FILE as a
// decimal integer n (empty or missing: 0), writes n+1 to it, prints
// "n token" and releases. Exit 2: not acquired; 3: not released.
package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	ticketd "github.com/ticketd/ticketd/clients/go"
)

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: contention-worker ADDR KEY CYCLES COUNTER_FILE")
		os.Exit(1)
	}
	addr, key, file := os.Args[1], os.Args[2], os.Args[4]
	cycles, err := strconv.Atoi(os.Args[3])
	if err != nil || cycles < 0 {
		fmt.Fprintln(os.Stderr, "CYCLES must be a count")
		os.Exit(1)
	}
	c, err := ticketd.Dial(addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer func() { _ = c.Close() }()
	out := bufio.NewWriter(os.Stdout)
	for i := 0; i < cycles; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		t, err := c.Acquire(ctx, key, 30*time.Second)
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "not acquired:", err)
			os.Exit(2)
		}
		n, err := bump(file)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Fprintf(out, "%d %d\n", n, t.Token())
		_ = out.Flush()
		if err := t.Release(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, "not released:", err)
			os.Exit(3)
		}
	}
}

// bump reads the counter and writes it plus one; it returns the old value.
func bump(file string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil && !os.IsNotExist(err) {
		return 0, err
	}
	var n int64
	if s := strings.TrimSpace(string(b)); s != "" {
		if n, err = strconv.ParseInt(s, 10, 64); err != nil {
			return 0, fmt.Errorf("counter file: %w", err)
		}
	}
	return n, os.WriteFile(file, []byte(strconv.FormatInt(n+1, 10)), 0o644)
}
