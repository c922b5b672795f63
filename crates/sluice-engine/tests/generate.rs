//! The generation callbacks' contract: tokens and the final flush arrive as distinct events,
//! a callback that breaks names the finish reason, and `chat_turn` ends at a stop sequence with
//! `FinishReason::StopSequence` and hands over exactly the text before it.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::output::{OutputEvent, OutputOptions};
use sluice_engine::sampler::SamplingParams;
use sluice_engine::turn::TurnEvent;
use sluice_engine::{Engine, FinishReason, GenerateRequest, Halt, LoadOptions, TokenEvent};

fn load() -> Engine<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe-q4");
    Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default()).unwrap()
}

const PROMPT: &[u32] = &[3, 10, 17, 24, 31];

fn request<'a>(params: &'a SamplingParams, max_tokens: usize) -> GenerateRequest<'a> {
    GenerateRequest {
        prompt: PROMPT,
        params,
        max_tokens,
        cancel: None,
        ignore_eos: true,
        checkpoint: None,
    }
}

#[test]
fn a_callback_break_names_the_finish_reason() {
    let engine = load();
    let params = SamplingParams::default();
    for (halt, finish) in [
        (Halt::StopSequence, FinishReason::StopSequence),
        (Halt::Cancel, FinishReason::Cancelled),
    ] {
        let mut tokens = 0;
        let stats = engine
            .generate_cached(None, &request(&params, 10), |event| {
                if let TokenEvent::Token { .. } = event {
                    tokens += 1;
                    if tokens == 3 {
                        return ControlFlow::Break(halt);
                    }
                }
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(stats.finish, finish);
        assert_eq!(stats.generated_tokens, 3);
    }
    let stats = engine
        .generate_cached(None, &request(&params, 4), |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(stats.finish, FinishReason::Length);
}

#[test]
fn the_flush_comes_last_and_is_not_a_token() {
    let engine = load();
    let mut flushed = 0;
    // Random tokens of a byte-level vocabulary often end inside a character; stopping right at
    // such a token leaves its bytes to the flush.
    for seed in 0..16 {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let mut events = Vec::new();
        let stats = engine
            .generate_cached(None, &request(&params, 48), |event| {
                let held_back = matches!(event, TokenEvent::Token { text: "", .. });
                events.push(match event {
                    TokenEvent::Token { id, text } => (Some(id), text.to_string()),
                    TokenEvent::Flush { text } => (None, text.to_string()),
                });
                if held_back {
                    ControlFlow::Break(Halt::Cancel)
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
        let tokens = events.iter().filter(|(id, _)| id.is_some()).count();
        assert_eq!(stats.generated_tokens, tokens, "seed {seed}");
        if let Some(at) = events.iter().position(|(id, _)| id.is_none()) {
            assert_eq!(at, events.len() - 1, "seed {seed}: the flush is not last");
            assert!(!events[at].1.is_empty(), "seed {seed}: an empty flush");
            flushed += 1;
        }
    }
    assert!(flushed > 0, "no generation ended with held-back text");
}

/// A chat turn over plain text: the concatenated content and the turn's events.
fn turn(
    engine: &Engine<CpuBackend>,
    max_tokens: usize,
    stop: &[&str],
    mut on_token: impl FnMut(usize) -> ControlFlow<()>,
) -> (String, Vec<TurnEvent>, sluice_engine::GenerationStats) {
    let params = SamplingParams::default();
    let output = OutputOptions {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..OutputOptions::default()
    };
    let mut events = Vec::new();
    let mut tokens = 0;
    let stats = engine
        .chat_turn(None, &request(&params, max_tokens), output, |event| {
            let flow = match event {
                TurnEvent::Token { .. } => {
                    tokens += 1;
                    on_token(tokens)
                }
                TurnEvent::End { .. } => ControlFlow::Continue(()),
            };
            events.push(event);
            flow
        })
        .unwrap();
    let content = events
        .iter()
        .cloned()
        .flat_map(TurnEvent::into_output)
        .map(|e| match e {
            OutputEvent::Content(t) => t,
            other => panic!("plain text parsed as {other:?}"),
        })
        .collect();
    (content, events, stats)
}

/// The turn's events are its tokens, then one `End`.
fn check_shape(events: &[TurnEvent], stats: &sluice_engine::GenerationStats) {
    let (last, tokens) = events.split_last().expect("an End event");
    assert!(matches!(last, TurnEvent::End { .. }), "{last:?}");
    assert!(tokens.iter().all(|e| matches!(e, TurnEvent::Token { .. })));
    assert_eq!(tokens.len(), stats.generated_tokens);
}

#[test]
fn a_chat_turn_hands_over_the_whole_text() {
    let engine = load();
    let params = SamplingParams::default();
    let mut text = String::new();
    engine
        .generate_cached(None, &request(&params, 24), |event| {
            let (TokenEvent::Token { text: t, .. } | TokenEvent::Flush { text: t }) = event;
            text.push_str(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    let (content, events, stats) = turn(&engine, 24, &[], |_| ControlFlow::Continue(()));
    assert_eq!(content, text);
    assert_eq!(stats.finish, FinishReason::Length);
    check_shape(&events, &stats);
}

#[test]
fn a_stop_sequence_ends_a_chat_turn_with_its_own_finish_reason() {
    let engine = load();
    let (text, _, _) = turn(&engine, 24, &[], |_| ControlFlow::Continue(()));
    // Two characters from a third of the way in: the stop comes before the last token.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() >= 6, "too little text to test with: {text:?}");
    let (from, _) = chars[chars.len() / 3];
    let to = chars
        .get(chars.len() / 3 + 2)
        .map_or(text.len(), |&(i, _)| i);
    let stop = &text[from..to];
    let before = &text[..text.find(stop).unwrap()];

    let (content, events, stats) = turn(&engine, 24, &[stop], |_| ControlFlow::Continue(()));
    assert_eq!(stats.finish, FinishReason::StopSequence, "stop {stop:?}");
    assert_eq!(content, before, "stop {stop:?}");
    assert!(stats.generated_tokens < 24, "{stats:?}");
    check_shape(&events, &stats);
}

#[test]
fn a_chat_turn_its_front_end_breaks_is_cancelled() {
    let engine = load();
    let (_, events, stats) = turn(&engine, 24, &[], |n| {
        if n == 2 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    assert_eq!(stats.finish, FinishReason::Cancelled);
    assert_eq!(stats.generated_tokens, 2);
    check_shape(&events, &stats);
}
