//! Babble is a contract violation, against the real local model server
//! (llama-server + SmolLM2, deploy/llm/): a reply refused as babble is asked again with
//! `frequency_penalty`, `presence_penalty` and llama.cpp's `repeat_penalty`, and the real
//! server takes that request and answers it with a reply that passes the contract.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cynode_pm::llm::contract::babble;
use cynode_pm::llm::{
    response_schema, system_prompt, ChatMessage, ContractError, LlmClient, ModelConfig,
    ReplyValidator,
};
use cynode_pm::skills::Registry;
use cynode_testkit::LocalModel;
use cynode_tests::workspace_root;

#[test]
fn the_real_model_server_takes_the_penalized_retry_of_a_babbling_reply() {
    let model = LocalModel::start(
        &workspace_root(),
        cynode_testkit::model::free_port(),
        Duration::from_secs(120),
    );
    let registry = Registry::load(&[workspace_root().join("skills/repo-inspect")]).unwrap();
    let catalog = registry.catalog();
    let schema = response_schema(&catalog, &[]);
    let validator = ReplyValidator::new(&schema, &catalog).unwrap();
    let mut cfg = ModelConfig::new(&model.base_url, "smollm2");
    cfg.max_tokens = 300;
    cfg.timeout = Duration::from_secs(90);
    let messages = vec![
        ChatMessage::system(system_prompt(&catalog)),
        ChatMessage::user(
            "Objective: say that the workspace is empty. Reply with a final whose summary is \
             one short sentence.",
        ),
    ];
    // The first reply is refused as babble whatever it says (the real model may or may
    // not babble on its own); the retry must go out penalized and come back valid. The
    // model is tiny and samples: one exchange may use up the client's retries on invalid
    // JSON (seen once in five runs), so up to three exchanges are tried, each
    // from the start; every failure is printed.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut failures = Vec::new();
    let mut done = None;
    for _ in 0..3 {
        let asked = AtomicU32::new(0);
        let check = |_: &cynode_protocol::llm::LlmOutput| {
            if asked.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(ContractError::Babble {
                    path: "payload.summary".into(),
                    why: babble::Babble::Repeated {
                        clause: "the plan is done".into(),
                        times: 3,
                    },
                });
            }
            Ok(())
        };
        match rt.block_on(LlmClient::new(cfg.clone()).next_reply_with(
            &messages,
            &schema,
            &validator,
            &[],
            check,
        )) {
            Ok(r) => {
                done = Some(r);
                break;
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let (reply, raw, attempts) = done.unwrap_or_else(|| {
        panic!(
            "the penalized retry failed on the real server three times: {failures:#?}; log: {}",
            std::fs::read_to_string(&model.log).unwrap_or_default()
        )
    });
    if !failures.is_empty() {
        eprintln!("exchanges that failed before one passed: {failures:#?}");
    }
    // Asked again after the refusal, and the answer passed the contract (babble check
    // included).
    assert!(attempts >= 2, "{attempts}");
    eprintln!("real model after a babble refusal: {:?}: {raw}", reply.kind);
}
