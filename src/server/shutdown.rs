//! Graceful shutdown: a [`ShutdownHandle`] or a signal (once
//! [`Server::handle_signals`] is called) asks for it; the
//! loop stops accepting, flushes every connection within the flush timeout,
//! then closes them and stops the service.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use std::io;

use mio::{Interest, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;

use crate::service::Service;
use crate::time::Millis;

use super::{millis, Server, SIGNALS};

/// Asks a running server to shut down, from any thread.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    flag: Arc<AtomicBool>,
    waker: Arc<Waker>,
}

impl ShutdownHandle {
    /// Starts a graceful shutdown: stop accepting, flush within the flush
    /// timeout, close. The loop notices on its next turn.
    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            log::error!("cannot wake the server loop for shutdown: {e}");
        }
    }
}

impl<S: Service> Server<S> {
    /// A handle that shuts the server down from any thread.
    #[must_use]
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            flag: Arc::clone(&self.stop_flag),
            waker: Arc::clone(&self.waker),
        }
    }

    /// Shuts down on SIGTERM and SIGINT (the daemon does this; an embedding
    /// program may prefer its own handling).
    ///
    /// # Errors
    /// The signal handlers cannot be installed.
    pub fn handle_signals(&mut self) -> io::Result<()> {
        let mut signals = Signals::new([SIGTERM, SIGINT])?;
        self.poll
            .registry()
            .register(&mut signals, SIGNALS, Interest::READABLE)?;
        self.signals = Some(signals);
        Ok(())
    }

    /// Stops accepting, and starts closing every connection after a flush
    /// bounded by the flush timeout.
    pub(super) fn begin_shutdown(&mut self, now: Millis) {
        log::info!(
            "shutting down: {} connections to flush within {} ms",
            self.conns.len(),
            millis(self.config.flush_timeout)
        );
        if let Some(n) = self.notify.as_mut() {
            n.send("STOPPING=1");
        }
        if let Some(mut l) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut l);
        }
        for (mut l, _) in self.unix.drain(..) {
            let _ = self.poll.registry().deregister(&mut l.listener);
        }
        self.shutdown_deadline = Some(now.add_ms(millis(self.config.flush_timeout)));
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for key in keys {
            self.start_close(now, key, false);
        }
    }

    /// Closes what is left, stops the service and the admin port: the
    /// server is stopped.
    pub(super) fn finish_shutdown(&mut self, now: Millis) {
        for mut c in self.conns.drain() {
            if let Some(tcp) = c.source() {
                let _ = self.poll.registry().deregister(tcp);
            }
        }
        self.conn_bytes = 0;
        self.service.stop(now);
        // The admin port goes with the loop: its listener and connections close.
        self.admin = None;
        self.closing.clear();
        self.active.clear();
        self.active_next.clear();
        self.dirty.clear();
        self.stopped = true;
        log::info!("stopped");
    }
}
