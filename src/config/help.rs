//! The text of `ticketd --help`.

/// The text `ticketd --help` prints.
pub const HELP: &str = "\
ticketd: a lock server with FIFO queues, bounded waits, leases and fencing tokens

USAGE:
    ticketd [FLAGS]
    ticketd --cluster --id N --peers 1=HOST:PORT,... --data-dir DIR [FLAGS]
                               cluster mode; `ticketd --cluster --help` for its flags
    ticketd --cluster ... --peer-tls-cert FILE --peer-tls-key FILE --peer-tls-ca FILE
                               peers speak mutual TLS (certificates: `ticket certs
                               init DIR`); --cluster-name NAME [ticketd] is part of
                               each node's certificate name; --insecure-peers allows
                               plaintext peers off loopback (docs/SECURITY.md)

FLAGS (defaults in brackets):
    --listen ADDR              address to listen on; port 0 picks a free port [127.0.0.1:7470].
                               An address that is not loopback is refused (protected
                               mode: exit 2) unless TLS (--tls-cert) or --insecure
                               is given
                               `--listen unix:/PATH` listens on a Unix socket; --listen
                               may be given several times (one TCP address at most)
    --insecure                 serve plaintext on an address that is not loopback:
                               anyone who reaches it can take and hold any lock.
                               Also uses a --data-dir its group or other users
                               may write to (refused otherwise, exit 1), with a
                               warning
    --tls-cert FILE            TLS (1.3 and 1.2) on the TCP listener with this
                               certificate chain (PEM); needs --tls-key
    --tls-key FILE             the certificate's private key (PEM)
    --tls-client-ca FILE       every client must present a certificate chaining to
                               this CA (PEM). With it, a listener that is not
                               loopback needs no --insecure
    --socket-mode OCTAL        permissions of Unix socket files (client and admin) [0660]
    --allow-uid N              only peers of this user id may use the Unix sockets,
                               the admin one included (SO_PEERCRED; repeatable;
                               with --allow-gid: either)
    --allow-gid N              only peers of this group id (repeatable)
    --max-conns N              open client connections [10000]
    --max-keys N               registered keys [1000000]
    --max-waiters N            queued acquires over all keys [100000]
    --max-waiters-per-key N    queued acquires on one key [1000]
    --max-key-bytes N          longest key in bytes, 1..=65536 [1024]
    --max-keys-per-identity N  keys one client identity may hold (ip:ADDR, uid:N,
                               cert:NAME; docs/SECURITY.md); more get B [500000]
    --max-waiters-per-identity N
                               acquires one identity may have queued [50000]
    --max-conns-per-identity N open connections of one identity; more are
                               accepted and closed at once [5000]
    --max-handshakes-per-identity N
                               TLS handshakes under way from one address [64]
    --handshake-timeout SECS   close a connection whose TLS handshake is not done
                               this long after the accept, or after
                               --frame-timeout if shorter [10]
    --max-memory BYTES         memory budget (suffix K, M or G) for keys, waiters
                               and connection buffers; past it new keys and
                               waiters get B, and connections are refused once
                               their buffers alone fill it [256M]
    --sweep-interval SECS      seconds between sweeps of expired keys [5]
    --max-hold SECS            single mode: longest a grant may be held, extensions
                               included; an extend past it gets X [0: no cap]
    --max-frames-per-turn N    requests handled per connection per loop turn [128]
    --out-soft-limit BYTES     unsent replies at which a connection is not read
                               [65536, or one reply with the longest key if more]
    --out-hard-limit BYTES     unsent replies at which a connection is closed
                               [4194304, or the soft limit plus one reply if more]
    --frame-timeout SECS       close a connection whose half-sent frame or unread
                               replies make no progress for this long; 0 = never [30]
    --data-dir DIR             keep the token high-water mark and the lease bound
                               in DIR, so tokens keep increasing across restarts and
                               a restart can wait for earlier leases [none: seed
                               tokens from the wall clock]
    --restart-grace auto|off   auto: with --data-dir, a restart holds every key
                               (acquires get T or queue, releases N) until every
                               lease the earlier run granted has ended; off: grant
                               at once. Without --data-dir there is nothing to
                               remember and no grace [auto]
    --max-lease SECS           longest lease an acquire or extend may ask for,
                               1..=255; a longer acquire is answered B, a longer
                               extend X. Also bounds the restart grace [255]
    --log-level LEVEL          off, error, warn, info, debug or trace [info]
    --admin-identity ID        cert:NAME (a client certificate's name) or uid:N (a
                               Unix-socket peer): may release or extend any grant
                               whose token it gives, and reads full tokens on the
                               admin port [none]
    --admin-listen ADDR        serve HTTP on ADDR: /livez, /readyz, /metrics
                               (Prometheus), /v1/locks, /v1/cluster; suggested
                               127.0.0.1:7471 (docs/OPERATIONS.md); `unix:/PATH`
                               serves it on a Unix socket (--socket-mode,
                               --allow-uid and --allow-gid apply to it) [off]
    --admin-tls-cert FILE      HTTPS (TLS 1.3 and 1.2) on a TCP admin port with this
                               certificate chain (PEM); needs --admin-tls-key
    --admin-tls-key FILE       its private key (PEM)
    --admin-tls-client-ca FILE every admin client (a scraper, `ticket`) must present
                               a certificate chaining to this CA (PEM)
    -h, --help                 print this help and exit
    -V, --version              print the version and exit

EXIT STATUS:
    0 stopped by SIGTERM or SIGINT, 1 could not start or failed, 2 bad command line
";
