//! Operations routes, unauthenticated and cheap: liveness, readiness, metrics, and the OpenAPI
//! document itself.
//!
//! The probes follow Kubernetes' names: `/livez` says the process is alive and touches nothing
//! (a liveness probe must not fail because PostgreSQL does, or every replica restarts at once
//! during a database outage); `/readyz` says whether this process should get traffic now;
//! `/healthz`, the older name, stays an alias of `/livez` (what it always answered).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::header;

use super::ErrorCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{AppState, ErrorBody};

/// How long `/readyz` waits for the database before answering "not ready".
const READY_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(livez))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Health {
    /// `ok` (alive) or `ready` (database reachable, migrations applied).
    status: &'static str,
}

/// The process is alive (for a liveness probe). Touches nothing else, not even the database, and
/// keeps answering 200 while the service shuts down.
#[utoipa::path(get, path = "/livez", tag = "operations",
    responses((status = 200, description = "alive", body = Health)))]
async fn livez() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// The older name of `/livez`, answering the same: the process is alive.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "alive (an alias of `/livez`)", body = Health)))]
async fn healthz() -> Json<Health> {
    livez().await
}

/// Whether this process should get traffic (for a readiness probe): not shutting down, no
/// background task down (one that panicked is restarting: [`crate::background`]), and the
/// database answers within a second and is current for this binary ([`crate::store::ready`]:
/// migrations applied, and whatever else the store needs).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "ready", body = Health),
        (status = 503, description = "`shutting_down`: SIGTERM received, the service is about to stop (it still serves for --shutdown-delay-seconds); `not_ready`: a background task panicked and is restarting, or the database is unreachable, slow, or not current for this version", body = ErrorBody),
    ))]
async fn readyz(State(state): State<AppState>) -> Response {
    if state.shutting_down.is_set() {
        return super::error_response(
            ErrorCode::ShuttingDown,
            "the service is shutting down; send requests to another replica",
        );
    }
    let down = state.background.down();
    if !down.is_empty() {
        let message = format!(
            "background task {} panicked and is restarting (credpool_background_task_restarts_total)",
            down.join(", ")
        );
        return super::error_response(ErrorCode::NotReady, &message);
    }
    let reason = match tokio::time::timeout(READY_TIMEOUT, crate::store::ready(&state.db)).await {
        Ok(Ok(true)) => return Json(Health { status: "ready" }).into_response(),
        Ok(Ok(false)) => "the database has not been migrated to this version",
        Ok(Err(_)) => "the database is unreachable",
        Err(_) => "the database did not answer within a second",
    };
    super::error_response(ErrorCode::NotReady, reason)
}

/// Every metric in Prometheus text format (see [`crate::telemetry`] for the series).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::render(state.db.pool().size(), state.db.pool().num_idle()),
    )
        .into_response()
}

/// Adds `GET /openapi.json` (served from the document itself) to the document.
pub(super) fn document_openapi_route(api: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    use utoipa::openapi::response::ResponseBuilder;
    let operation = OperationBuilder::new()
        .tag("operations")
        .summary(Some("This OpenAPI document"))
        .response(
            "200",
            ResponseBuilder::new()
                .description("the OpenAPI 3 document of every route")
                .content(
                    "application/json",
                    utoipa::openapi::ContentBuilder::new()
                        .schema(Some(utoipa::openapi::ObjectBuilder::new()))
                        .build(),
                ),
        )
        .build();
    api.paths.paths.insert(
        "/openapi.json".to_owned(),
        PathItem::new(HttpMethod::Get, operation),
    );
}
