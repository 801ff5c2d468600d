//! Just enough of the Chrome DevTools Protocol to drive the system's Chromium from a test:
//! start it headless, open a page, evaluate script, click with the mouse, accept dialogs
//! and take screenshots. Nothing is downloaded: it uses `/usr/bin/chromium` (Debian's
//! `chromium` package) or `$SKIPLOCK_CHROMIUM`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

/// How long one protocol command or one wait may take: only guards a hang, so generous
/// enough for a loaded machine.
const LIMIT: Duration = Duration::from_secs(60);

/// Viewport of the page, CSS pixels.
pub const WIDTH: u32 = 1280;
pub const HEIGHT: u32 = 900;

/// The Chromium to use, if one is installed.
pub fn chromium_path() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("SKIPLOCK_CHROMIUM").map(PathBuf::from),
        Some(PathBuf::from("/usr/bin/chromium")),
        Some(PathBuf::from("/usr/bin/chromium-browser")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A headless Chromium with one page; the browser is killed when this is dropped.
pub struct Browser {
    outgoing: mpsc::UnboundedSender<String>,
    pending: Pending,
    next_id: Arc<AtomicU64>,
    session: String,
    /// Messages of the dialogs (`confirm`, `alert`) accepted so far.
    pub dialogs: Arc<Mutex<Vec<String>>>,
    _child: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium with the flags it needs as root on a machine without network, a
    /// fresh profile, and attaches to a blank page.
    pub async fn start(executable: &PathBuf) -> Browser {
        let profile = tempfile::tempdir().expect("profile directory");
        let mut child = Command::new(executable)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                &format!("--window-size={WIDTH},{HEIGHT}"),
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromium");
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        let ws_url = tokio::time::timeout(LIMIT, async {
            while let Some(line) = stderr.next_line().await.expect("chromium stderr") {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    return url.trim().to_owned();
                }
            }
            panic!("chromium exited before opening its DevTools port");
        })
        .await
        .expect("chromium did not open its DevTools port in time");
        // Keep draining stderr so Chromium never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = stderr.next_line().await {} });

        let (socket, _) = tokio_tungstenite::connect_async(ws_url.as_str())
            .await
            .expect("connect to chromium's DevTools socket");
        let (mut sink, mut stream) = socket.split();
        let (outgoing, mut queue) = mpsc::unbounded_channel::<String>();
        tokio::spawn(async move {
            while let Some(text) = queue.recv().await {
                if sink.send(Message::text(text)).await.is_err() {
                    break;
                }
            }
        });
        let pending: Pending = Arc::default();
        let dialogs: Arc<Mutex<Vec<String>>> = Arc::default();
        let next_id = Arc::new(AtomicU64::new(1));
        {
            let pending = pending.clone();
            let dialogs = dialogs.clone();
            let outgoing = outgoing.clone();
            let next_id = next_id.clone();
            tokio::spawn(async move {
                while let Some(Ok(message)) = stream.next().await {
                    let Message::Text(text) = message else {
                        continue;
                    };
                    let Ok(value) = serde_json::from_str::<Value>(text.as_str()) else {
                        continue;
                    };
                    if let Some(id) = value.get("id").and_then(Value::as_u64) {
                        if let Some(reply) = pending.lock().unwrap().remove(&id) {
                            let _ = reply.send(value);
                        }
                    } else if value["method"] == "Page.javascriptDialogOpening" {
                        // Accept at once: a dialog blocks the page (and a pending input
                        // command) until someone answers it.
                        let message = value["params"]["message"].as_str().unwrap_or("").to_owned();
                        dialogs.lock().unwrap().push(message);
                        let id = next_id.fetch_add(1, Ordering::Relaxed);
                        let answer = json!({
                            "id": id,
                            "method": "Page.handleJavaScriptDialog",
                            "params": { "accept": true },
                            "sessionId": value["sessionId"],
                        });
                        let _ = outgoing.send(answer.to_string());
                    }
                }
            });
        }
        let mut browser = Browser {
            outgoing,
            pending,
            next_id,
            session: String::new(),
            dialogs,
            _child: child,
            _profile: profile,
        };
        let target = browser
            .call_in(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let attached = browser
            .call_in(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        browser.session = attached["sessionId"].as_str().unwrap().to_owned();
        browser.call("Page.enable", json!({})).await;
        browser.set_height(HEIGHT).await;
        browser
    }

    async fn call_in(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, reply);
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        self.outgoing
            .send(message.to_string())
            .expect("DevTools socket open");
        let response = tokio::time::timeout(LIMIT, answer)
            .await
            .unwrap_or_else(|_| panic!("no answer to {method} within {LIMIT:?}"))
            .expect("DevTools socket open");
        if let Some(error) = response.get("error") {
            panic!("{method} failed: {error}");
        }
        response["result"].clone()
    }

    /// Runs a protocol command on the page.
    pub async fn call(&self, method: &str, params: Value) -> Value {
        self.call_in(Some(&self.session), method, params).await
    }

    /// Evaluates `expression` in the page and returns its value as JSON.
    pub async fn eval(&self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("script {expression:?} threw: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Polls `condition` (a script expression) until it is true; panics after the limit.
    pub async fn wait_for(&self, what: &str, condition: &str) {
        let deadline = Instant::now() + LIMIT;
        let check = format!(
            "(() => {{ try {{ return !!({condition}); }} catch (e) {{ return false; }} }})()"
        );
        while self.eval(&check).await != json!(true) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Opens `url` and waits until it has loaded.
    pub async fn goto(&self, url: &str) {
        self.call("Page.navigate", json!({ "url": url })).await;
        self.wait_for(
            &format!("{url} to load"),
            &format!(
                "location.href === {} && document.readyState === 'complete'",
                json!(url)
            ),
        )
        .await;
    }

    /// Clicks the middle of the first element matching `selector`, with the mouse.
    pub async fn click(&self, selector: &str) {
        let script = format!(
            "(() => {{ const e = document.querySelector({}); if (!e) return null;
                      e.scrollIntoView({{ block: 'center' }});
                      const r = e.getBoundingClientRect();
                      return [r.x + r.width / 2, r.y + r.height / 2]; }})()",
            json!(selector)
        );
        let point = self.eval(&script).await;
        let (x, y) = match point.as_array() {
            Some(xy) => (xy[0].as_f64().unwrap(), xy[1].as_f64().unwrap()),
            None => panic!("nothing matches {selector}"),
        };
        for kind in ["mouseMoved", "mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 }),
            )
            .await;
        }
    }

    async fn set_height(&self, height: u32) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
    }

    /// A PNG of the whole page (up to 3000 px tall).
    pub async fn screenshot(&self) -> Vec<u8> {
        let height = self
            .eval("document.documentElement.scrollHeight")
            .await
            .as_u64()
            .unwrap_or(u64::from(HEIGHT))
            .clamp(u64::from(HEIGHT), 3000) as u32;
        self.set_height(height).await;
        let shot = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        self.set_height(HEIGHT).await;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("screenshot is base64")
    }
}
