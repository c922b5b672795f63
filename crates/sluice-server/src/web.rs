//! The web page at `/`: a chat with the model and a live view of the expert cache. Its files
//! (`src/web/`) are compiled into the binary: nothing is fetched from elsewhere at run time, and
//! no build step runs (the libraries in `src/web/vendor/` are their projects' own minified
//! releases; see `src/web/vendor/README.md`).

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// One file of the page: (name under `/assets/`, content type, bytes).
macro_rules! asset {
    ($name:literal, $kind:expr) => {
        ($name, $kind, include_bytes!(concat!("web/", $name)))
    };
}

const ASSETS: &[(&str, &str, &[u8])] = &[
    asset!("app.js", JS),
    asset!("chat.js", JS),
    asset!("util.js", JS),
    asset!("experts.js", JS),
    asset!("app.css", CSS),
    asset!("favicon.svg", "image/svg+xml"),
    asset!("vendor/marked.esm.js", JS),
    asset!("vendor/uPlot.iife.min.js", JS),
    asset!("vendor/uPlot.min.css", CSS),
    asset!("vendor/hljs/core.min.js", JS),
    asset!("vendor/hljs/languages/bash.min.js", JS),
    asset!("vendor/hljs/languages/c.min.js", JS),
    asset!("vendor/hljs/languages/cpp.min.js", JS),
    asset!("vendor/hljs/languages/go.min.js", JS),
    asset!("vendor/hljs/languages/javascript.min.js", JS),
    asset!("vendor/hljs/languages/json.min.js", JS),
    asset!("vendor/hljs/languages/python.min.js", JS),
    asset!("vendor/hljs/languages/rust.min.js", JS),
    asset!("vendor/hljs/languages/typescript.min.js", JS),
    asset!("vendor/hljs/languages/xml.min.js", JS),
];

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const INDEX: &[u8] = include_bytes!("web/index.html");

/// The page may run only its own scripts and talk only to this server: model output that slips
/// HTML past the Markdown renderer still cannot run code or load anything.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The bytes of everything the page loads, for the size it is reported at.
pub fn page_bytes() -> usize {
    INDEX.len() + ASSETS.iter().map(|a| a.2.len()).sum::<usize>()
}

/// `GET /`.
pub(crate) async fn index() -> Response {
    file("text/html; charset=utf-8", INDEX)
}

/// `GET /assets/{*name}`.
pub(crate) async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.0 == name) {
        Some(&(_, kind, bytes)) => file(kind, bytes),
        None => ApiError::invalid(format!("no such file: /assets/{name}"))
            .with_status(StatusCode::NOT_FOUND)
            .into_response(),
    }
}

fn file(kind: &'static str, bytes: &'static [u8]) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            // The files change with the binary only; revalidating costs little on loopback.
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        bytes,
    )
        .into_response()
}
