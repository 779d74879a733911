// Command bench measures acquire+release cycles per second through the Go
// client, for 1 and 16 goroutines, each on a key of its own, against a
// ticketd it starts (target/{debug,release}/ticketd, or $TICKETD_BIN, or
// -ticketd-bin) or the one at -addr.
//
// Go's standard library has no Redis client, so there is no Redis column
// here (clients/python/bench.py has one).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	ticketd "github.com/ticketd/ticketd/clients/go"
	"github.com/ticketd/ticketd/clients/go/internal/ticketdproc"
)

func main() {
	addr := flag.String("addr", "", "a running ticketd (default: start one)")
	bin := flag.String("ticketd-bin", "", "the ticketd binary to start")
	seconds := flag.Float64("seconds", 2, "seconds per cell")
	rounds := flag.Int("rounds", 3, "rounds per cell (the median is printed)")
	flag.Parse()
	if *addr == "" {
		b := *bin
		if b == "" {
			var err error
			if b, err = ticketdproc.Binary(); err != nil {
				fail(err)
			}
		}
		s, err := ticketdproc.Start(b)
		if err != nil {
			fail(err)
		}
		defer s.Stop()
		*addr = s.Addr
		fmt.Printf("ticketd: %s at %s\n", b, s.Addr)
	}
	c, err := ticketd.Dial(*addr)
	if err != nil {
		fail(err)
	}
	defer func() { _ = c.Close() }()
	d := time.Duration(*seconds * float64(time.Second))
	fmt.Println("No Redis column: Go's standard library has no Redis client.")
	fmt.Println("goroutines  cycles/s (median)  rounds")
	for _, g := range []int{1, 16} {
		var rates []float64
		for r := 0; r < *rounds; r++ {
			rate, err := cell(c, g, d)
			if err != nil {
				fail(err)
			}
			rates = append(rates, rate)
		}
		sort.Float64s(rates)
		fmt.Printf("%10d  %17.0f  %v\n", g, rates[len(rates)/2], rounded(rates))
	}
}

// cell runs g goroutines of acquire+release cycles for d.
func cell(c *ticketd.Client, g int, d time.Duration) (float64, error) {
	var n atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, g)
	start := time.Now()
	stop := start.Add(d)
	for i := 0; i < g; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			key := fmt.Sprintf("bench-%d", i)
			for time.Now().Before(stop) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				t, err := c.Acquire(ctx, key, 30*time.Second)
				cancel()
				if err != nil {
					errs <- err
					return
				}
				if err := t.Release(context.Background()); err != nil {
					errs <- err
					return
				}
				n.Add(1)
			}
		}(i)
	}
	wg.Wait()
	select {
	case err := <-errs:
		return 0, err
	default:
	}
	return float64(n.Load()) / time.Since(start).Seconds(), nil
}

func rounded(v []float64) []int {
	out := make([]int, len(v))
	for i, x := range v {
		out[i] = int(x + 0.5)
	}
	return out
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}
