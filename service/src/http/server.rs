//! The HTTP/1 server under connection limits: sockets that send nothing, half a
//! request, or nothing more after a response cannot starve the service.
//!
//! `axum::serve` keeps every connection until its client closes it: with the open-file limit at
//! 128, 200 silent sockets made `/livez`, `/readyz` and allocate time out (`accept error: Too
//! many open files`) for as long as they stayed open, no key needed. Here each connection is
//! served by hyper's HTTP/1 connection (with a timer, so that its own `header_read_timeout` is
//! the backstop) and watched by its task ([`Watch`]):
//!
//! - **header read timeout**: a request head must arrive whole within
//!   `--http-header-read-timeout-seconds` of its first byte, and a new connection must send its
//!   first request head within that long of being accepted;
//! - **idle timeout**: a keep-alive connection with no request in flight is closed after
//!   `--http-idle-timeout-seconds` without a new one (longer than load balancers' own idle
//!   timeouts, so that they close first);
//! - **connection cap**: at `--http-max-connections` open connections (lowered at start-up to fit
//!   the process's open-file limit, keeping room for the database pool), a new connection closes
//!   the oldest connection that has no request in flight, so that a probe or an executor that
//!   connects gets served at once however many idle sockets are open; when every connection has
//!   a request in flight, accepting pauses until one ends (the kernel's backlog holds new ones).
//!
//! A request in flight is bounded by the request timeout (`observe`), its body included (the
//! relay's by its own limits: its wait, its upstream's `timeout_seconds`). It counts as in flight
//! until its response's body has been written whole: a streamed answer is never an idle connection.
//! hyper's own header timer is set to the longer of the two timeouts: a backstop, not the rule
//! (it would also close keep-alive connections at the header timeout, which load balancers that
//! keep connections 60 s would then find closed under them).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// The limits on connections (`--http-*` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// How long a request head may take from its first byte, and a new connection from its
    /// accept to its first request head (default 10 s).
    pub header_read_timeout: Duration,
    /// How long a keep-alive connection stays open with no request (default 75 s).
    pub idle_timeout: Duration,
    /// Connections open at once (default 1024; lowered to fit the open-file limit:
    /// [`HttpLimits::fitted_to_open_files`]).
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(75),
            max_connections: 1024,
        }
    }
}

/// File descriptors kept for everything but client connections, besides the database pool: the
/// listener, the LISTEN connection, token endpoint calls, log files, the runtime's own.
const RESERVED_FDS: u64 = 64;

/// The fewest connections the cap is ever lowered to.
const MIN_CONNECTIONS: usize = 16;

impl HttpLimits {
    /// These limits with `max_connections` lowered, when needed, to what the process's soft
    /// open-file limit leaves once `db_connections` and [`RESERVED_FDS`] are kept aside (an
    /// accept that fails with "too many open files" is what starved the probes; a database
    /// connection that cannot be opened fails every allocate). Logs when it lowers the cap.
    pub fn fitted_to_open_files(self, db_connections: u32) -> Self {
        let Ok((soft, _)) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        else {
            return self;
        };
        let budget = soft.saturating_sub(RESERVED_FDS + u64::from(db_connections));
        let fitted = usize::try_from(budget)
            .unwrap_or(usize::MAX)
            .max(MIN_CONNECTIONS);
        if fitted < self.max_connections {
            tracing::warn!(
                configured = self.max_connections,
                max_connections = fitted,
                open_file_limit = soft,
                "--http-max-connections lowered to fit the open-file limit (ulimit -n)"
            );
            return Self {
                max_connections: fitted,
                ..self
            };
        }
        self
    }
}

/// Serves `router` on `listener` under `limits` until `shutdown` resolves; then stops accepting,
/// asks every connection to close once its request in flight has been answered, and returns
/// when all have closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let connections = Connections::new(limits.max_connections);
    let (stop, stopping) = watch::channel(false);
    let service = TowerToHyperService::new(router);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            () = connections.room() => tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => accepted,
            },
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // "too many open files" (another part of the process used the descriptors):
                // free one, and give the process a moment
                tracing::warn!(error = %error, "accept failed");
                connections.evict_one();
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // small request / response pairs: without TCP_NODELAY a response written in two
        // segments can wait for the client's delayed ACK (~40 ms)
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(error = %error, "could not set TCP_NODELAY");
        }
        let watch = connections.add();
        let (service, stopping, connections) =
            (service.clone(), stopping.clone(), connections.clone());
        tokio::spawn(async move {
            run(stream, service, watch.clone(), limits, stopping).await;
            connections.remove(&watch);
        });
    }
    drop(listener);
    let _ = stop.send(true);
    connections.closed().await;
    Ok(())
}

/// Serves one connection until it closes, its client goes quiet for longer than the limits
/// allow, the cap evicts it, or (after the request in flight) the server stops.
async fn run(
    stream: TcpStream,
    service: TowerToHyperService<Router>,
    watch: Arc<Watch>,
    limits: HttpLimits,
    mut stopping: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout.max(limits.idle_timeout))
        .keep_alive(true);
    let io = TokioIo::new(Watched {
        inner: stream,
        watch: watch.clone(),
    });
    let counted = Counted {
        inner: service,
        watch: watch.clone(),
    };
    let connection = builder.serve_connection(io, counted);
    tokio::pin!(connection);
    let mut closing = *stopping.borrow();
    if closing {
        connection.as_mut().graceful_shutdown();
    }
    loop {
        let deadline = watch.deadline(&limits);
        let changed = watch.changed.notified();
        let evicted = watch.evict.notified();
        tokio::select! {
            served = connection.as_mut() => {
                if let Err(error) = served {
                    tracing::debug!(error = %error, "connection ended with an error");
                }
                return;
            }
            _ = stopping.changed(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            () = changed => {}
            () = evicted => {
                if watch.busy.load(Ordering::SeqCst) == 0 {
                    crate::telemetry::http_connection_dropped("evicted");
                    return;
                }
                if !closing {
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
            }
            () = sleep_until(deadline), if deadline.is_some() => {
                if let Some(reason) = watch.expired(&limits) {
                    crate::telemetry::http_connection_dropped(reason);
                    return;
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What a connection's task watches: its requests in flight, when its last one ended, when its
/// current request head started to arrive. Times are milliseconds since `accepted`.
#[derive(Debug)]
struct Watch {
    id: u64,
    accepted: Instant,
    /// Requests being served now.
    busy: AtomicUsize,
    /// Whether a response has been sent (the connection is a keep-alive one since).
    served: AtomicBool,
    /// When the last response was handed to hyper.
    last_done_ms: AtomicU64,
    /// 1 + when the first byte of a request head arrived while no request was in flight; 0:
    /// none arrived since.
    head_since_ms: AtomicU64,
    /// Told to close (the cap needs its descriptor).
    evicting: AtomicBool,
    /// Rings when `busy` or `head_since_ms` change, so the deadline is computed again.
    changed: Notify,
    /// Rings when the cap evicts it.
    evict: Notify,
    /// The acceptor's [`Connections::room`] bell, rung when a request ends: this connection may
    /// be evicted now.
    room: Arc<Notify>,
}

impl Watch {
    fn new(id: u64, room: Arc<Notify>) -> Self {
        Self {
            id,
            accepted: Instant::now(),
            busy: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            last_done_ms: AtomicU64::new(0),
            head_since_ms: AtomicU64::new(0),
            evicting: AtomicBool::new(false),
            changed: Notify::new(),
            evict: Notify::new(),
            room,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.accepted.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, ms: u64) -> Instant {
        self.accepted + Duration::from_millis(ms)
    }

    /// When the connection is to be closed unless something happens first; `None` while a
    /// request is in flight.
    fn deadline(&self, limits: &HttpLimits) -> Option<Instant> {
        if self.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let head = self.head_since_ms.load(Ordering::SeqCst);
        Some(if head > 0 {
            self.at(head - 1) + limits.header_read_timeout
        } else if !self.served.load(Ordering::SeqCst) {
            self.accepted + limits.header_read_timeout
        } else {
            self.at(self.last_done_ms.load(Ordering::SeqCst)) + limits.idle_timeout
        })
    }

    /// Why the connection is to be closed now, if it is: `header_timeout` or `idle_timeout`.
    fn expired(&self, limits: &HttpLimits) -> Option<&'static str> {
        let deadline = self.deadline(limits)?;
        if Instant::now() < deadline {
            return None;
        }
        let idle =
            self.served.load(Ordering::SeqCst) && self.head_since_ms.load(Ordering::SeqCst) == 0;
        Some(if idle {
            "idle_timeout"
        } else {
            "header_timeout"
        })
    }

    /// Bytes arrived: the start of a request head, when no request is in flight.
    fn read(&self) {
        if self.busy.load(Ordering::SeqCst) == 0 && self.head_since_ms.load(Ordering::SeqCst) == 0 {
            self.head_since_ms
                .store(self.now_ms() + 1, Ordering::SeqCst);
            self.changed.notify_one();
        }
    }
}

/// A request in flight on a connection, until its response's body has been written whole (or
/// dropped): a streamed answer (the relay's) is a request in flight, however long it streams, not
/// an idle connection to close or evict.
struct Busy(Arc<Watch>);

impl Busy {
    fn start(watch: Arc<Watch>) -> Self {
        watch.busy.fetch_add(1, Ordering::SeqCst);
        watch.head_since_ms.store(0, Ordering::SeqCst);
        watch.changed.notify_one();
        Self(watch)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let watch = &self.0;
        watch.last_done_ms.store(watch.now_ms(), Ordering::SeqCst);
        watch.served.store(true, Ordering::SeqCst);
        watch.busy.fetch_sub(1, Ordering::SeqCst);
        watch.changed.notify_one();
        watch.room.notify_one();
    }
}

/// The router, counting each request on its connection's [`Watch`].
#[derive(Clone)]
struct Counted {
    inner: TowerToHyperService<Router>,
    watch: Arc<Watch>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Counted {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let busy = Busy::start(self.watch.clone());
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            // a body already whole in memory (every JSON answer) is written at once: only a
            // streamed one keeps its request busy while it is written
            if hyper::body::Body::size_hint(response.body())
                .exact()
                .is_some()
            {
                drop(busy);
                return Ok(response);
            }
            Ok(response.map(|inner| axum::body::Body::new(BusyBody { inner, _busy: busy })))
        })
    }
}

/// A response body that keeps its request [`Busy`] until hyper has written its last frame and
/// dropped it.
struct BusyBody {
    inner: axum::body::Body,
    _busy: Busy,
}

impl hyper::body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's socket, telling its [`Watch`] when bytes arrive.
struct Watched {
    inner: TcpStream,
    watch: Arc<Watch>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.watch.read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The open connections, oldest first, and the cap.
#[derive(Debug, Clone)]
struct Connections {
    open: Arc<Mutex<BTreeMap<u64, Arc<Watch>>>>,
    next_id: Arc<AtomicU64>,
    max: usize,
    /// Rings when a connection closes or finishes a request: there may be room again.
    room: Arc<Notify>,
    /// How many are open, for the end of a shutdown.
    count: Arc<watch::Sender<usize>>,
}

impl Connections {
    fn new(max: usize) -> Self {
        Self {
            open: Arc::new(Mutex::new(BTreeMap::new())),
            next_id: Arc::new(AtomicU64::new(0)),
            max: max.max(1),
            room: Arc::new(Notify::new()),
            count: Arc::new(watch::channel(0).0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Watch>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self) -> Arc<Watch> {
        let watch = Arc::new(Watch::new(
            self.next_id.fetch_add(1, Ordering::SeqCst),
            self.room.clone(),
        ));
        let mut open = self.lock();
        open.insert(watch.id, watch.clone());
        self.count.send_replace(open.len());
        crate::telemetry::http_connections(open.len());
        watch
    }

    fn remove(&self, watch: &Watch) {
        let mut open = self.lock();
        open.remove(&watch.id);
        self.count.send_replace(open.len());
        crate::telemetry::http_connections(open.len());
        drop(open);
        self.room.notify_one();
    }

    /// Tells the oldest connection with no request in flight to close; whether there was one.
    fn evict_one(&self) -> bool {
        let open = self.lock();
        let victim = open
            .values()
            .find(|w| !w.evicting.load(Ordering::SeqCst) && w.busy.load(Ordering::SeqCst) == 0);
        match victim {
            Some(watch) => {
                watch.evicting.store(true, Ordering::SeqCst);
                watch.evict.notify_one();
                true
            }
            None => false,
        }
    }

    /// Resolves once a new connection may be accepted: under the cap. At the cap it makes room
    /// first: the oldest connection with no request in flight is told to close, and this waits
    /// for a close (so descriptors never run ahead of the closes). When every connection has a
    /// request in flight, it waits for one to end (the kernel's backlog holds new connections
    /// meanwhile), looking again at least every second.
    async fn room(&self) {
        loop {
            let notified = self.room.notified();
            if self.lock().len() < self.max {
                return;
            }
            self.evict_one();
            let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
        }
    }

    /// Resolves once every connection has closed.
    async fn closed(&self) {
        let mut count = self.count.subscribe();
        let _ = count.wait_for(|n| *n == 0).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(75),
            max_connections: 2,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_a_request_that_ends_lets_the_acceptor_evict_its_connection_at_once() {
        // One connection allowed, and it has a request in flight: the acceptor waits. When the
        // request ends, the connection is idle and may be evicted: the acceptor is told then,
        // not at its once-a-second look.
        let connections = Connections::new(1);
        let watch = connections.add();
        let busy = Busy::start(watch.clone());
        let acceptor = tokio::spawn({
            let connections = connections.clone();
            async move { connections.room().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!watch.evicting.load(Ordering::SeqCst), "evicted while busy");
        drop(busy);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            watch.evicting.load(Ordering::SeqCst),
            "the acceptor did not hear that the request ended"
        );
        connections.remove(&watch);
        acceptor.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_has_the_header_timeout_until_served_then_the_idle_timeout() {
        let watch = Arc::new(Watch::new(0, Arc::new(Notify::new())));
        let start = watch.accepted;
        assert_eq!(
            watch.deadline(&limits()),
            Some(start + Duration::from_secs(10))
        );
        tokio::time::advance(Duration::from_secs(3)).await;
        let busy = Busy::start(watch.clone());
        assert_eq!(watch.deadline(&limits()), None);
        tokio::time::advance(Duration::from_secs(30)).await;
        drop(busy);
        // idle since the response: 75 s from then
        assert_eq!(
            watch.deadline(&limits()),
            Some(start + Duration::from_secs(33 + 75))
        );
        // a byte of the next head: 10 s from then
        tokio::time::advance(Duration::from_secs(5)).await;
        watch.read();
        assert_eq!(
            watch.deadline(&limits()),
            Some(start + Duration::from_secs(38 + 10))
        );
        assert_eq!(watch.expired(&limits()), None);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(watch.expired(&limits()), Some("header_timeout"));
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_oldest_connection_without_a_request_makes_room() {
        let connections = Connections::new(2);
        let (first, second) = (connections.add(), connections.add());
        let _busy = Busy::start(first.clone());
        // at the cap: the busy one is kept, the idle one is told to close, and room comes when
        // it has closed
        let room = tokio::spawn({
            let connections = connections.clone();
            async move { connections.room().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!first.evicting.load(Ordering::SeqCst));
        assert!(second.evicting.load(Ordering::SeqCst));
        assert!(!room.is_finished());
        connections.remove(&second);
        room.await.unwrap();
        // every connection busy: nothing to evict, no room until one ends
        let third = connections.add();
        let _also_busy = Busy::start(third.clone());
        assert!(!connections.evict_one());
        let waited = tokio::time::timeout(Duration::from_secs(5), connections.room()).await;
        assert!(waited.is_err(), "room while every connection is busy");
    }
}
