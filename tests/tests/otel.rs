//! Observability end to end: the real `cynode-pm run` with its local bwrap worker and a
//! scripted model. With `CYNODE_OTLP_ENDPOINT` pointing at an in-test OTLP/HTTP receiver
//! the session's spans arrive as protobuf in one trace, the worker (which inherits the
//! variable) exports its `request` and `job` spans into the same trace under the PM's
//! submit call, and logs the same trace id (from the `traceparent` header) on the job's
//! lines. Without it, the PM's JSON
//! log lines still carry session_id, and job lines job_id, task_id and skill_id.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use serde_json::{json, Value};
use std::collections::BTreeMap;

use cynode_tests::otlp::{otlp_collector, Bodies};
use cynode_tests::{final_state, model_server, pm_with, serve_in_background, session_id};

/// A minimal OTLP/HTTP collector, served over plain HTTP.
fn otlp_receiver() -> (String, Bodies) {
    let (app, bodies) = otlp_collector();
    (format!("http://{}", serve_in_background(app)), bodies)
}

/// One exported span, flattened.
#[derive(Debug)]
struct Span {
    /// The exporting process's `service.name`.
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attrs: BTreeMap<String, String>,
}

fn spans(bodies: &Bodies) -> (Vec<Span>, Vec<BTreeMap<String, String>>) {
    let attrs = |kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]| {
        kvs.iter()
            .map(|kv| {
                let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(AnyValue::StringValue(s)) => s.clone(),
                    Some(AnyValue::IntValue(i)) => i.to_string(),
                    Some(AnyValue::BoolValue(b)) => b.to_string(),
                    other => format!("{other:?}"),
                };
                (kv.key.clone(), v)
            })
            .collect::<BTreeMap<_, _>>()
    };
    let mut out = Vec::new();
    let mut resources = Vec::new();
    for (ct, body) in bodies.lock().unwrap().iter() {
        assert_eq!(ct, "application/x-protobuf");
        let req = ExportTraceServiceRequest::decode(body.as_slice()).expect("OTLP protobuf");
        for rs in req.resource_spans {
            let resource = attrs(&rs.resource.map(|r| r.attributes).unwrap_or_default());
            let service = resource.get("service.name").cloned().unwrap_or_default();
            resources.push(resource);
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(Span {
                        service: service.clone(),
                        name: s.name.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attrs: attrs(&s.attributes),
                    });
                }
            }
        }
    }
    (out, resources)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `cynode-pm run "greet the world"` with `env` set, its model scripted to write
/// hello.txt in one job.
fn greet(state: &std::path::Path, env: (&str, &str)) -> std::process::Output {
    let (url, _model) = model_server(cynode_tests::one_job_script(
        "write the greeting",
        "write-files",
        json!({ "files": [{ "path": "hello.txt", "content": "hello\n" }] }),
        "wrote hello.txt",
    ));
    pm_with(state, &url, &["run", "greet the world"], &[env])
}

/// The job id the session dispatched (from its `job_dispatched` event).
fn dispatched_job(v: &Value) -> String {
    v["state"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "job_dispatched")
        .unwrap_or_else(|| panic!("no job_dispatched in {v}"))["data"]["job_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The JSON lines of a log (other lines skipped).
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.is_object())
        .collect()
}

/// A field of the line's spans (innermost wins), as a string.
fn span_field(line: &Value, key: &str) -> Option<String> {
    line["spans"]
        .as_array()?
        .iter()
        .rev()
        .find_map(|s| s[key].as_str().map(str::to_string))
}

#[test]
fn otlp_traces_arrive_and_the_worker_logs_the_same_trace_id() {
    let (collector, bodies) = otlp_receiver();
    let state = cynode_tests::tempdir().unwrap();
    let out = greet(state.path(), ("CYNODE_OTLP_ENDPOINT", collector.as_str()));
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let sid = session_id(&out);
    let job_id = dispatched_job(&v);

    // The provider was flushed before the process exited: everything is here now.
    let (spans, resources) = spans(&bodies);
    assert!(!spans.is_empty(), "no spans exported");
    let services: std::collections::BTreeSet<&str> = resources
        .iter()
        .filter_map(|r| r.get("service.name").map(String::as_str))
        .collect();
    assert_eq!(
        services,
        ["cynode-pm", "cynode-worker"].into(),
        "{resources:?}"
    );
    let session = spans
        .iter()
        .find(|s| s.name == "session")
        .unwrap_or_else(|| panic!("no session span in {spans:?}"));
    assert_eq!(session.attrs.get("session_id"), Some(&sid), "{session:?}");
    let trace_id = session.trace_id.clone();
    assert!(
        spans.iter().all(|s| s.trace_id == trace_id),
        "one trace per run: {spans:?}"
    );
    let turns: Vec<&Span> = spans.iter().filter(|s| s.name == "turn").collect();
    assert!(turns.len() >= 3, "{spans:?}");
    assert!(turns
        .iter()
        .all(|t| t.attrs.get("session_id") == Some(&sid)));
    let job_attrs = |name: &str| {
        let s = spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {spans:?}"));
        (
            s.attrs.get("job_id").cloned(),
            s.attrs.get("task_id").cloned(),
            s.attrs.get("skill_id").cloned(),
        )
    };
    let expected = (
        Some(job_id.clone()),
        Some("t1".to_string()),
        Some("write-files".to_string()),
    );
    assert_eq!(job_attrs("request_job"), expected);
    assert_eq!(job_attrs("await_job"), expected);
    let submit = spans
        .iter()
        .find(|s| {
            s.name == "worker_call"
                && s.attrs.get("url.path").map(String::as_str) == Some("/v1/worker/jobs")
        })
        .unwrap_or_else(|| panic!("no submit call in {spans:?}"));
    assert_eq!(
        submit.attrs.get("http.request.method").map(String::as_str),
        Some("POST")
    );
    assert_eq!(
        submit
            .attrs
            .get("http.response.status_code")
            .map(String::as_str),
        Some("202")
    );

    // The worker's spans continue the trace: its `request` span is a child of the PM's
    // submit call, and the job's `job` span a child of that request.
    let worker_request = spans
        .iter()
        .find(|s| s.service == "cynode-worker" && s.parent_span_id == submit.span_id)
        .unwrap_or_else(|| panic!("no worker span under the submit call in {spans:?}"));
    assert_eq!(worker_request.name, "request");
    assert_eq!(
        worker_request.attrs.get("path").map(String::as_str),
        Some("/v1/worker/jobs")
    );
    let job_span = spans
        .iter()
        .find(|s| s.service == "cynode-worker" && s.name == "job")
        .unwrap_or_else(|| panic!("no worker job span in {spans:?}"));
    assert_eq!(
        (
            job_span.attrs.get("job_id"),
            job_span.parent_span_id.as_str()
        ),
        (Some(&job_id), worker_request.span_id.as_str()),
        "{job_span:?}"
    );

    // The local worker got `traceparent` on the job's calls and logged its trace id.
    let log = std::fs::read_to_string(state.path().join("worker/worker.log")).unwrap();
    let lines = json_lines(&log);
    let job_lines: Vec<&Value> = lines
        .iter()
        .filter(|l| l["fields"]["job_id"] == json!(job_id))
        .collect();
    let messages: Vec<&str> = job_lines
        .iter()
        .map(|l| l["fields"]["message"].as_str().unwrap_or(""))
        .collect();
    assert!(messages.contains(&"job started"), "{messages:?}\n{log}");
    assert!(messages.contains(&"job finished"), "{messages:?}\n{log}");
    for l in &job_lines {
        assert_eq!(span_field(l, "trace_id"), Some(trace_id.clone()), "{l}");
        // The parent the worker saw is the PM's client span of the submit call.
        assert_eq!(
            span_field(l, "parent_span_id"),
            Some(submit.span_id.clone()),
            "{l}"
        );
    }
}

#[test]
fn log_lines_in_a_session_carry_its_ids_and_no_traceparent_without_an_endpoint() {
    let state = cynode_tests::tempdir().unwrap();
    let out = greet(state.path(), ("CYNODE_LOG_LEVEL", "info,cynode_pm=debug"));
    let v = final_state(&out);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let sid = session_id(&out);
    let job_id = dispatched_job(&v);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = json_lines(&stderr)
        .into_iter()
        .filter(|l| l["target"].as_str().unwrap_or("").starts_with("cynode_pm"))
        .collect();
    assert!(!lines.is_empty(), "{stderr}");
    for l in &lines {
        assert_eq!(span_field(l, "session_id"), Some(sid.clone()), "{l}");
    }
    // Every worker call about the job is logged with the job's ids.
    let job_calls: Vec<&Value> = lines
        .iter()
        .filter(|l| {
            l["fields"]["message"] == "worker answered"
                && l["fields"]["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/v1/worker/jobs"))
        })
        .collect();
    let paths: Vec<&str> = job_calls
        .iter()
        .map(|l| l["fields"]["path"].as_str().unwrap())
        .collect();
    assert!(paths.contains(&"/v1/worker/jobs"), "{paths:?}");
    assert!(
        paths.contains(&format!("/v1/worker/jobs/{job_id}:ack").as_str()),
        "{paths:?}"
    );
    for l in &job_calls {
        let ids = (
            span_field(l, "job_id"),
            span_field(l, "task_id"),
            span_field(l, "skill_id"),
        );
        assert_eq!(
            ids,
            (
                Some(job_id.clone()),
                Some("t1".to_string()),
                Some("write-files".to_string())
            ),
            "{l}"
        );
    }
    // Without an endpoint no traceparent is sent: the worker logs no trace id.
    let log = std::fs::read_to_string(state.path().join("worker/worker.log")).unwrap();
    assert!(
        json_lines(&log)
            .iter()
            .all(|l| span_field(l, "trace_id").is_none()),
        "{log}"
    );
}
