//! One command at a time on the machine's disks. A wipe, a stream and a kexec (which writes the seed) each change
//! the disks; two at once would interleave writes, or the second would fail on the first's `O_EXCL` open. That
//! happens when the control plane gives up on a slow command at its deadline and asks again while the first is
//! still stopping (zeroing what it wrote): the second waits its turn, within its own deadline, instead of failing
//! the machine with "device busy".

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a command without a deadline waits for the disks.
pub const WAIT_WITHOUT_DEADLINE: Duration = Duration::from_secs(600);

/// Which command holds the disks, if any.
#[derive(Default)]
pub struct DiskGate {
    holder: Mutex<Option<String>>,
    freed: Condvar,
}

/// The disks, held until dropped.
pub struct DiskTurn<'a> {
    gate: &'a DiskGate,
}

impl DiskGate {
    /// Waits until no other command holds the disks, then holds them for `who` (e.g. `ramdisk.stream c-12`).
    /// Gives up at `deadline` (or [`WAIT_WITHOUT_DEADLINE`] from now) with an error naming the holder.
    pub fn enter(&self, who: &str, deadline: Option<Instant>) -> Result<DiskTurn<'_>, String> {
        let began = Instant::now();
        let until = deadline.unwrap_or(began + WAIT_WITHOUT_DEADLINE);
        fn poisoned<T>(_: T) -> String {
            "the disk gate is unusable (a command panicked holding it)".into()
        }
        let mut holder = self.holder.lock().map_err(poisoned)?;
        while let Some(current) = holder.as_deref() {
            let now = Instant::now();
            if now >= until {
                return Err(format!(
                    "{current} still held the disks after {} ms; {who} was not run (retry once it ends)",
                    now.duration_since(began).as_millis()
                ));
            }
            tracing::info!(waiting = who, holder = current, "waiting for the disks");
            holder = self
                .freed
                .wait_timeout(holder, until - now)
                .map_err(poisoned)?
                .0;
        }
        *holder = Some(who.to_owned());
        Ok(DiskTurn { gate: self })
    }
}

impl Drop for DiskTurn<'_> {
    fn drop(&mut self) {
        if let Ok(mut holder) = self.gate.holder.lock() {
            *holder = None;
        }
        self.gate.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_second_command_waits_for_the_first_and_gives_up_at_its_deadline() {
        let gate = Arc::new(DiskGate::default());
        let first = gate.enter("ramdisk.stream a", None).expect("free");
        // A second one whose deadline comes first: refused, naming the holder.
        let early = Instant::now() + Duration::from_millis(200);
        let err = gate
            .enter("ramdisk.stream b", Some(early))
            .err()
            .expect("the disks are held");
        assert!(
            err.starts_with("ramdisk.stream a still held the disks after ")
                && err.ends_with("ramdisk.stream b was not run (retry once it ends)"),
            "{err}"
        );
        assert!(Instant::now() >= early);
        // A third, with time: runs as soon as the first lets go.
        let (g, entered) = (gate.clone(), Arc::new(Mutex::new(None)));
        let seen = entered.clone();
        let waiter = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            let turn = g.enter("ramdisk.wipe c", Some(deadline));
            *seen.lock().expect("lock") = Some(Instant::now());
            turn.map(|_| ())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(entered.lock().expect("lock").is_none(), "it waits");
        let released = Instant::now();
        drop(first);
        waiter.join().expect("thread").expect("entered");
        let at = entered.lock().expect("lock").expect("entered");
        assert!(at >= released && at - released < Duration::from_secs(2));
        // And let go again: the gate is free.
        drop(
            gate.enter("ramdisk.kexec d", Some(Instant::now()))
                .expect("free"),
        );
    }
}
