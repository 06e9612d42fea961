//! A session's inference (`use_inference: true`, checked as a command job's by
//! [`crate::executor::inference_models`]): the node's inference listener at
//! [`crate::inference::listener::ADDR`] inside the session's network namespace, one proxy
//! (its allowed models, request budget and audit, under the session's id) for the session's
//! whole life, and one token (`OPENAI_API_KEY`) for all its commands.
//!
//! - A keep-alive container (Podman or Docker with runc/crun) keeps one network namespace:
//!   the listener binds there once, before any command runs, and stops when the session
//!   ends.
//! - bubblewrap runs each command as a sandbox of its own: each exec binds a listener of
//!   its own in that sandbox's namespace (after the egress proxy's, when the session has
//!   one), serving the same proxy, and stops with the command.

use std::sync::{Arc, Mutex, MutexGuard};

use cynode_tls::ListenerLimits;

use crate::inference::listener::{new_token, JobInference};
use crate::inference::{Proxy, Upstream};

/// One session's inference.
#[derive(Debug)]
pub(super) struct SessionInference {
    proxy: Arc<Proxy>,
    token: String,
    limits: ListenerLimits,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The session-long listener of a keep-alive container, while it runs.
    whole: Option<JobInference>,
    /// The session's listener is the session-long one (set once it is bound).
    is_whole: bool,
    /// The session ended: no listener starts any more.
    ended: bool,
}

impl SessionInference {
    pub(super) fn new(
        session_id: &str,
        models: Vec<String>,
        upstream: Arc<Upstream>,
        limits: ListenerLimits,
    ) -> Arc<Self> {
        Arc::new(SessionInference {
            proxy: Proxy::new(session_id, models, upstream),
            token: new_token(),
            limits,
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The bearer the session's commands get as `OPENAI_API_KEY`.
    pub(super) fn token(&self) -> &str {
        &self.token
    }

    fn listener(&self) -> JobInference {
        JobInference::new(
            Arc::clone(&self.proxy),
            self.token.clone(),
            self.limits.clone(),
        )
    }

    /// Binds the session-long listener in the network namespace of `pid` (the keep-alive
    /// container's init). `Err`: the session must not start.
    pub(super) async fn bind_whole(&self, pid: u32) -> Result<(), String> {
        let listener = self.listener();
        listener.hook()(pid).await?;
        let mut s = self.state();
        if s.ended {
            return Err("the session ended while its inference listener started".into());
        }
        s.whole = Some(listener);
        s.is_whole = true;
        Ok(())
    }

    /// A listener of the exec's own (bound by its hook, stopped when dropped), or `None`
    /// when the session-long one serves it.
    pub(super) fn exec_listener(&self) -> Option<JobInference> {
        let s = self.state();
        (!s.is_whole && !s.ended).then(|| self.listener())
    }

    /// The session ended: the session-long listener stops (closing its connections) and
    /// the session's totals are logged, once.
    pub(super) fn finish(&self) {
        let (whole, first) = {
            let mut s = self.state();
            let first = !s.ended;
            s.ended = true;
            (s.whole.take(), first)
        };
        drop(whole);
        if first {
            self.proxy.log_totals();
        }
    }
}
