//! The PM's model hop over real TLS: a scripted model that speaks only HTTPS, with a
//! certificate from a CA made in the test, trusted through `--ca-file` or `SSL_CERT_FILE`,
//! and refused when nothing trusts it.

use cynode_testkit::TestCa;
use serde_json::Value;

use cynode_tests::{
    completed, final_state, happy_script, model_app, pm_with, serve_https_in_background,
};

/// Serves the scripted model over HTTPS only, from a thread of its own.
fn https_model(dir: &std::path::Path, ca: &TestCa) -> (String, cynode_tests::Model) {
    let (app, model) = model_app(happy_script());
    let addr = serve_https_in_background(app, ca, dir, "model");
    (format!("https://127.0.0.1:{}/v1", addr.port()), model)
}

#[test]
fn a_model_that_speaks_only_https_is_reached_with_ca_file_or_ssl_cert_file() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "model");
    let ca_file = ca.cert_file.display().to_string();
    for (how, args, envs) in [
        ("--ca-file", vec!["--ca-file", ca_file.as_str()], vec![]),
        (
            "SSL_CERT_FILE",
            vec![],
            vec![("SSL_CERT_FILE", ca_file.as_str())],
        ),
    ] {
        let (url, model) = https_model(dir.path(), &ca);
        let state = cynode_tests::tempdir().unwrap();
        let mut all = vec!["run", "greet the world"];
        all.extend(args);
        let out = pm_with(state.path(), &url, &all, &envs);
        let v = completed(&out);
        assert_eq!(
            (v["jobs_dispatched"].clone(), model.requests().len()),
            (serde_json::json!(2), 4),
            "{how}: {v}"
        );
    }
}

#[test]
fn an_untrusted_model_certificate_fails_the_session_naming_the_cause() {
    let dir = cynode_tests::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "model");
    let (url, model) = https_model(dir.path(), &ca);
    let state = cynode_tests::tempdir().unwrap();
    let out = pm_with(
        state.path(),
        &url,
        &["run", "greet the world", "--model-timeout-seconds", "10"],
        &[],
    );
    let v: Value = final_state(&out);
    let text = format!("{v}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["status"], "failed", "{text}");
    assert!(
        text.contains("certificate") || text.contains("UnknownIssuer"),
        "the failure does not name the certificate problem: {text}"
    );
    assert!(model.requests().is_empty(), "a request got through: {text}");
}
