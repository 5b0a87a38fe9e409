//! A service run inside the command's own process: `credpool demo`, and `credpool bench`
//! without `--url`.

use std::sync::Arc;

use credpool::config::ServiceArgs;
use credpool::database::Database;
use credpool::http::ApiKeys;
use credpool::secrets::Keyring;
use credpool::startup::Application;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The in-process service, serving in a task of its own until [`LocalService::stop`].
pub(crate) struct LocalService {
    /// `http://127.0.0.1:{port}`.
    pub(crate) base: String,
    /// The executor key it accepts (random, this run's only).
    pub(crate) internal_key: String,
    /// The admin key it accepts (random, this run's only).
    pub(crate) admin_key: String,
    stop: oneshot::Sender<()>,
    server: JoinHandle<std::io::Result<()>>,
}

impl LocalService {
    /// Binds the service on 127.0.0.1 (a port the system chooses) on `database`, with fresh
    /// random executor and admin keys, and serves it.
    pub(crate) async fn start(
        database: &Database,
        keyring: Arc<Keyring>,
        service: &ServiceArgs,
    ) -> anyhow::Result<Self> {
        let internal_key = hex::encode(rand::random::<[u8; 16]>());
        let admin_key = hex::encode(rand::random::<[u8; 16]>());
        let keys =
            ApiKeys::new(internal_key.clone(), admin_key.clone()).map_err(anyhow::Error::msg)?;
        let app = Application::bind(
            "127.0.0.1:0",
            database.pool.clone(),
            keys,
            keyring,
            &service.settings(),
        )
        .await?;
        let base = format!("http://{}", app.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(app.run_until(async {
            let _ = stopped.await;
        }));
        Ok(Self {
            base,
            internal_key,
            admin_key,
            stop,
            server,
        })
    }

    /// Stops serving and waits for the server to finish.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.server.await??;
        Ok(())
    }
}
