//! Fencing: a storage that remembers the highest token it has seen and
//! refuses writes carrying a lower one, so a client that lost its lock (a
//! long pause, an expired lease) cannot overwrite the work of the next holder.
//!
//! ```text
//! cargo run --release --bin ticketd &
//! cargo run --example fenced_write -- [HOST:PORT]
//! ```

use std::sync::Mutex;
use std::time::Duration;

use ticketd::client::{Client, DEFAULT_ADDRESS};

/// A toy resource guarded by fencing tokens.
#[derive(Default)]
struct FencedStore {
    inner: Mutex<Store>,
}

#[derive(Default)]
struct Store {
    highest_token: u64,
    value: String,
}

impl FencedStore {
    /// Applies the write only if `token` is not older than any seen before.
    fn write(&self, token: u64, value: &str) -> Result<(), String> {
        let mut s = self.inner.lock().unwrap();
        if token < s.highest_token {
            return Err(format!(
                "stale token {token}: {} has been seen",
                s.highest_token
            ));
        }
        s.highest_token = token;
        s.value = value.to_owned();
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_ADDRESS.into());
    let client = Client::connect(addr)?;
    let store = FencedStore::default();
    let wait = Duration::from_secs(5);

    // Writer A takes the lock with a 1 s lease, then stalls past it.
    let a = client
        .acquire("report", wait, Duration::from_secs(1))?
        .ticket()
        .ok_or("A did not get the lock")?;
    store.write(a.token(), "A: first draft")?;
    println!("A wrote with token {}", a.token());
    let (_, a_token) = a.detach(); // A "pauses" without releasing...
    std::thread::sleep(Duration::from_millis(1500));

    // ...its lease ends, and B gets the lock with a larger token.
    let b = client
        .acquire("report", wait, Duration::from_secs(10))?
        .ticket()
        .ok_or("B did not get the lock")?;
    store.write(b.token(), "B: final")?;
    println!("B wrote with token {}", b.token());

    // A wakes up and tries to write: the fence refuses it.
    match store.write(a_token, "A: stale overwrite") {
        Ok(()) => println!("A's stale write went through (should not happen)"),
        Err(e) => println!("A's write refused: {e}"),
    }
    println!(
        "stored value: {:?}",
        store.inner.lock().unwrap().value.as_str()
    );
    b.release()?;
    Ok(())
}
