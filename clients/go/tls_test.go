package ticketd

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// makeCerts makes, with openssl, two CAs (ca, other), a server certificate
// for localhost and 127.0.0.1 from ca, and a client certificate from each
// CA (client, stranger).
func makeCerts(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Fatal("openssl is needed to make the test certificates: ", err)
	}
	d := t.TempDir()
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(d, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("server.ext", "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
	write("client.ext", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
	run := func(args ...string) {
		cmd := exec.Command("openssl", args...)
		cmd.Dir = d
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("openssl %v: %v\n%s", args, err, out)
		}
	}
	ec := []string{"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"}
	for _, ca := range []string{"ca", "other"} {
		run(append(append([]string{"req", "-x509"}, ec...), "-days", "2", "-subj", "/CN=test "+ca,
			"-keyout", ca+"-key.pem", "-out", ca+".pem")...)
	}
	for _, l := range [][3]string{{"server", "ca", "server.ext"}, {"client", "ca", "client.ext"}, {"stranger", "other", "client.ext"}} {
		run(append(append([]string{"req"}, ec...), "-subj", "/CN="+l[0], "-keyout", l[0]+"-key.pem", "-out", l[0]+".csr")...)
		run("x509", "-req", "-in", l[0]+".csr", "-CA", l[1]+".pem", "-CAkey", l[1]+"-key.pem",
			"-CAcreateserial", "-days", "2", "-extfile", l[2], "-out", l[0]+".pem")
	}
	return d
}

func TestTLSWithAClientCertificate(t *testing.T) {
	certs := makeCerts(t)
	f := func(n string) string { return filepath.Join(certs, n) }
	sock := filepath.Join(shortTempDir(t), "t.sock")
	s := startServer(t, "--listen", "unix:"+sock, "--tls-cert", f("server.pem"), "--tls-key", f("server-key.pem"),
		"--tls-client-ca", f("ca.pem"))
	plain := dial(t, "unix:"+sock)
	// No certificate, or one from another CA: never a grant.
	for _, cfg := range []Config{
		{TLSCAFile: f("ca.pem")},
		{TLSCAFile: f("ca.pem"), TLSCertFile: f("stranger.pem"), TLSKeyFile: f("stranger-key.pem")},
	} {
		cfg.Addrs, cfg.PoolSize = []string{s.Addr}, 1
		c := newClient(t, cfg)
		_, err := c.Acquire(within(time.Second), "m", 5*time.Second)
		if !errors.Is(err, ErrTimeout) && !errors.Is(err, ErrIndeterminate) {
			t.Fatalf("%+v: %v", cfg, err)
		}
		if holds(t, plain, "m") {
			t.Fatal("granted without a good client certificate")
		}
	}
	// The right one, to 127.0.0.1 and to localhost: both names are in the
	// server's certificate.
	for _, addr := range []string{s.Addr, strings.Replace(s.Addr, "127.0.0.1", "localhost", 1)} {
		c := newClient(t, Config{Addrs: []string{addr}, TLSCAFile: f("ca.pem"),
			TLSCertFile: f("client.pem"), TLSKeyFile: f("client-key.pem")})
		tk := mustAcquire(t, c, "m", 5*time.Second)
		if !holds(t, plain, "m") {
			t.Fatal("not held over TLS")
		}
		if err := tk.Extend(within(5*time.Second), 10*time.Second); err != nil {
			t.Fatal(err)
		}
		if err := tk.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func TestTLSRefusesAServerItCannotCheck(t *testing.T) {
	certs := makeCerts(t)
	f := func(n string) string { return filepath.Join(certs, n) }
	s := startServer(t, "--tls-cert", f("server.pem"), "--tls-key", f("server-key.pem"))
	for _, cfg := range []Config{
		{TLSCAFile: f("other.pem")},
		{TLSCAFile: f("ca.pem"), TLSServerName: "db.example"},
	} {
		cfg.Addrs, cfg.PoolSize = []string{s.Addr}, 1
		c := newClient(t, cfg)
		// Refused before a byte of the request was sent: a timeout.
		if _, err := c.Acquire(within(time.Second), "k", 5*time.Second); !errors.Is(err, ErrTimeout) {
			t.Fatalf("%+v: %v", cfg, err)
		}
		if e := c.LastConnectError(); e == nil || !strings.Contains(e.Error(), "TLS") {
			t.Fatalf("last connect error %v", e)
		}
	}
	good := newClient(t, Config{Addrs: []string{s.Addr}, TLSCAFile: f("ca.pem"), TLSServerName: "localhost"})
	tk := mustAcquire(t, good, "k", 5*time.Second)
	if err := tk.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	// A plaintext client on the TLS port gets nothing.
	bare := dial(t, s.Addr)
	if _, err := bare.Acquire(within(time.Second), "k", 5*time.Second); !errors.Is(err, ErrNotAcquired) {
		t.Fatalf("plaintext: %v", err)
	}
}
