//! Supervised background tasks: the loops a service process runs besides its requests
//! (the OAuth refresher, the candidate views' refresh, the group workers, the waiters' listener,
//! liveness and announcements, the cleanup scheduler, the metrics sampler) cannot die silently.
//!
//! A task is a future made by a factory. When it panics, the [`Supervisor`] counts it
//! (`credpool_background_task_restarts_total{task}`), marks it down
//! (`credpool_background_tasks_down{task}`, and `/readyz` answers 503 `not_ready` naming it), and
//! makes it again after a backoff (1 s, doubling up to 30 s; back to 1 s once a run lasted a
//! minute). Before, one panic (an OAuth token answer whose `expires_in` overflowed a timestamp)
//! ended the refresher for the life of the process while `/readyz` said ready.
//!
//! A task that *returns* has ended on purpose: every task here returns only when what it works
//! for is gone (its application dropped, its pool closed, its channel's senders dropped), so the
//! supervisor ends with it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The first delay before a panicked task is made again.
pub const FIRST_RESTART_DELAY: Duration = Duration::from_secs(1);
/// The longest delay before a panicked task is made again.
pub const MAX_RESTART_DELAY: Duration = Duration::from_secs(30);
/// A run at least this long resets the delay to [`FIRST_RESTART_DELAY`].
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// The supervisor of one service process's background tasks. Cheap to clone; every clone is the
/// same registry.
#[derive(Debug, Clone, Default)]
pub struct Supervisor {
    /// Task name -> instances down now (panicked, waiting to be made again).
    down: Arc<Mutex<BTreeMap<&'static str, usize>>>,
}

impl Supervisor {
    /// A supervisor with no task yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs the future `make` returns as task `name` (a fixed, bounded metric label), making it
    /// again after each panic, until a run returns. Several instances may share a name (the
    /// group workers of one kind). Must run in a Tokio runtime. Aborting the returned handle stops
    /// the task and its supervision.
    pub fn spawn<F, Fut>(&self, name: &'static str, mut make: F) -> tokio::task::JoinHandle<()>
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        crate::telemetry::background_task_known(name);
        let down = self.down.clone();
        tokio::spawn(async move {
            let mut delay = FIRST_RESTART_DELAY;
            loop {
                let started = Instant::now();
                // aborted with this loop (a handle dropped does not abort its task)
                let mut run = AbortOnDrop(tokio::spawn(make()));
                let ended = (&mut run.0).await;
                match ended {
                    Ok(()) => return,
                    Err(error) if error.is_cancelled() => return,
                    Err(error) => {
                        if started.elapsed() >= HEALTHY_RUN {
                            delay = FIRST_RESTART_DELAY;
                        }
                        let message = panic_message(error.into_panic());
                        tracing::error!(task = name, panic = %message, restart_in_seconds = delay.as_secs_f64(),
                            "background task panicked; restarting it");
                        crate::telemetry::background_task_restarted(name);
                        let mark = Down::mark(&down, name);
                        tokio::time::sleep(delay).await;
                        drop(mark);
                        delay = (delay * 2).min(MAX_RESTART_DELAY);
                    }
                }
            }
        })
    }

    /// The tasks down now (panicked and waiting to be made again), by name: `/readyz` answers
    /// 503 while there is one.
    pub fn down(&self) -> Vec<&'static str> {
        self.down
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(name, _)| *name)
            .collect()
    }
}

/// One instance of a task marked down, until dropped (also when its supervision is aborted
/// during the delay).
struct Down {
    down: Arc<Mutex<BTreeMap<&'static str, usize>>>,
    name: &'static str,
}

impl Down {
    fn mark(down: &Arc<Mutex<BTreeMap<&'static str, usize>>>, name: &'static str) -> Self {
        let mut tasks = down.lock().unwrap_or_else(|p| p.into_inner());
        let n = tasks.entry(name).or_default();
        *n += 1;
        crate::telemetry::background_tasks_down(name, *n);
        Self {
            down: down.clone(),
            name,
        }
    }
}

impl Drop for Down {
    fn drop(&mut self) {
        let mut tasks = self.down.lock().unwrap_or_else(|p| p.into_inner());
        let n = tasks.entry(self.name).or_default();
        *n = n.saturating_sub(1);
        crate::telemetry::background_tasks_down(self.name, *n);
    }
}

/// A task handle that aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a panic said, when it said it in text.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(text) => *text,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "(no message)".to_owned(), |text| (*text).to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_task_that_panics_is_down_for_the_delay_then_made_again_until_it_returns() {
        let supervisor = Supervisor::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let handle = supervisor.spawn("test_task", move || {
            let run = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if run < 2 {
                    panic!("run {run} fails");
                }
            }
        });
        // the first run panics at once: down for the first delay
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(supervisor.down(), ["test_task"]);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // made again after 1 s, panics again: down for 2 s
        tokio::time::sleep(FIRST_RESTART_DELAY).await;
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert_eq!(supervisor.down(), ["test_task"]);
        tokio::time::sleep(FIRST_RESTART_DELAY * 2).await;
        // the third run returns: up, and supervision ends with it
        handle.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        assert!(supervisor.down().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn aborting_the_supervision_stops_the_task_and_clears_its_mark() {
        let supervisor = Supervisor::new();
        let handle = supervisor.spawn("test_abort", || async { panic!("always") });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(supervisor.down(), ["test_abort"]);
        handle.abort();
        let _ = handle.await;
        assert!(supervisor.down().is_empty());
    }
}
