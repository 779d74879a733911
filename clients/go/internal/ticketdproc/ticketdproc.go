// Package ticketdproc starts a real ticketd process for the tests, the
// benchmark and the examples of this module.
package ticketdproc

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"
)

// Binary finds the server: $TICKETD_BIN, else the newest of
// target/{debug,release}/ticketd in the repository around the working
// directory.
func Binary() (string, error) {
	if b := os.Getenv("TICKETD_BIN"); b != "" {
		return b, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "Cargo.toml")); err == nil {
			best, bestTime := "", time.Time{}
			for _, p := range []string{"debug", "release"} {
				f := filepath.Join(dir, "target", p, "ticketd")
				if st, err := os.Stat(f); err == nil && st.ModTime().After(bestTime) {
					best, bestTime = f, st.ModTime()
				}
			}
			if best != "" {
				return best, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no ticketd binary: build it (cargo build) or set TICKETD_BIN")
		}
		dir = parent
	}
}

// Server is a running ticketd.
type Server struct {
	// Addr is its TCP address (host:port).
	Addr string
	cmd  *exec.Cmd
	end  sync.Mutex // held while the process is being ended
	over bool
	mu   sync.Mutex
	log  strings.Builder
	done chan struct{}
}

var listening = regexp.MustCompile(`listening on (\S+)`)

// Start runs the binary with --listen 127.0.0.1:0 and args, and waits for
// its "listening on" line.
func Start(bin string, args ...string) (*Server, error) {
	cmd := exec.Command(bin, append([]string{"--listen", "127.0.0.1:0"}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Server{cmd: cmd, done: make(chan struct{})}
	found := make(chan string, 1)
	go s.drain(stderr, found)
	select {
	case addr, ok := <-found:
		if ok {
			s.Addr = addr
			return s, nil
		}
	case <-time.After(30 * time.Second):
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	return nil, fmt.Errorf("ticketd did not start: %s", s.Log())
}

func (s *Server) drain(r io.Reader, found chan string) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		s.mu.Lock()
		s.log.WriteString(line + "\n")
		s.mu.Unlock()
		if found != nil {
			if m := listening.FindStringSubmatch(line); m != nil {
				found <- m[1]
				found = nil
			}
		}
	}
	if found != nil {
		close(found)
	}
	close(s.done)
}

// Log is what the server wrote to stderr so far.
func (s *Server) Log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

// Stop ends the server with SIGTERM (SIGKILL after 10 s) and waits.
func (s *Server) Stop() {
	s.end.Lock()
	defer s.end.Unlock()
	if s.over {
		return
	}
	s.over = true
	_ = s.cmd.Process.Signal(os.Interrupt)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
	}
	_ = s.cmd.Wait()
}

// Kill ends the server with SIGKILL and waits.
func (s *Server) Kill() {
	s.end.Lock()
	defer s.end.Unlock()
	if s.over {
		return
	}
	s.over = true
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
}
