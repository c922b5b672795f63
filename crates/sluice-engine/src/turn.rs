//! One answer read as chat output: [`Engine::chat_turn`] runs a generation and reads its text
//! with an [`OutputParser`], so that front ends (the server, `sluice chat`) get reasoning,
//! content and tool calls instead of raw text, and a stop sequence ends the generation with
//! [`FinishReason::StopSequence`](crate::FinishReason::StopSequence).

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_backend::Backend;

use crate::batch::Sink;
use crate::output::{OutputEvent, OutputOptions, OutputParser};
use crate::prompt_cache::PromptCache;
use crate::{Engine, EngineError, GenerateRequest, GenerationStats, Halt, TokenEvent};

/// What [`Engine::chat_turn`] hands its callback, in order: one `Token` per generated token, then
/// one `End`.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnEvent {
    /// A token was generated. `output` is what its text made certain; often nothing, since text
    /// that might still become a marker or a stop sequence is held back.
    Token { id: u32, output: Vec<OutputEvent> },
    /// The generation is over: the output that was still held back (possibly nothing).
    End { output: Vec<OutputEvent> },
}

impl TurnEvent {
    /// The parsed output this event carries.
    pub fn into_output(self) -> Vec<OutputEvent> {
        match self {
            TurnEvent::Token { output, .. } | TurnEvent::End { output } => output,
        }
    }
}

/// A chat turn's [`Sink`]: reads the generated text with an [`OutputParser`] and hands
/// `on_event` the parsed output as it becomes certain. A stop sequence in the text ends the
/// generation with [`StopSequence`](crate::FinishReason::StopSequence); `on_event` breaking ends
/// it as [`Cancelled`](crate::FinishReason::Cancelled). [`TurnSink::end`] sends the `End`.
pub struct TurnSink<'a, F> {
    parser: OutputParser,
    held: Vec<OutputEvent>,
    on_event: F,
    cancel: Option<&'a AtomicBool>,
}

impl<'a, F: FnMut(TurnEvent) -> ControlFlow<()>> TurnSink<'a, F> {
    pub fn new(output: OutputOptions, cancel: Option<&'a AtomicBool>, on_event: F) -> Self {
        TurnSink {
            parser: OutputParser::new(output),
            held: Vec::new(),
            on_event,
            cancel,
        }
    }

    /// After the generation ended well: the output still held back, as `End`. Returns the stop
    /// sequence that ended it, if one did.
    pub fn end(mut self) -> Option<String> {
        self.held.extend(self.parser.finish());
        let _ = (self.on_event)(TurnEvent::End { output: self.held });
        self.parser.stop_sequence().map(str::to_string)
    }
}

impl<F: FnMut(TurnEvent) -> ControlFlow<()>> Sink for TurnSink<'_, F> {
    fn event(&mut self, event: TokenEvent<'_>) -> ControlFlow<Halt> {
        match event {
            TokenEvent::Token { id, text } => {
                let output = self.parser.push(text);
                let flow = (self.on_event)(TurnEvent::Token { id, output });
                if self.parser.stopped() {
                    ControlFlow::Break(Halt::StopSequence)
                } else if flow.is_break() {
                    ControlFlow::Break(Halt::Cancel)
                } else {
                    ControlFlow::Continue(())
                }
            }
            // Not a token: its output goes out with the parser's own held-back text.
            TokenEvent::Flush { text } => {
                self.held = self.parser.push(text);
                ControlFlow::Continue(())
            }
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.is_some_and(|c| c.load(Ordering::Relaxed))
    }
}

impl<B: Backend + 'static> Engine<B> {
    /// Generates `request` (resuming from and saving to `cache`, as
    /// [`generate_cached`](Engine::generate_cached)) and reads the text with an [`OutputParser`]
    /// set up by `output`, handing `on_event` the parsed output as it becomes certain.
    ///
    /// The generation stops after a token when `on_event` breaks (the answer is no longer
    /// wanted: [`Cancelled`](crate::FinishReason::Cancelled)) or when the text reaches one of
    /// `output.stop` ([`StopSequence`](crate::FinishReason::StopSequence), which wins when both
    /// happen at the same token). Either way the output of that token is handed over first. `End`
    /// comes last unless the generation fails.
    pub fn chat_turn(
        &self,
        mut cache: Option<&mut PromptCache<B>>,
        request: &GenerateRequest<'_>,
        output: OutputOptions,
        on_event: impl FnMut(TurnEvent) -> ControlFlow<()>,
    ) -> Result<GenerationStats, EngineError> {
        let sink = TurnSink::new(output, request.cancel, on_event);
        let sequence = self.sequence(cache.as_deref_mut(), request, sink)?;
        let (stats, sink) = crate::batch::run_alone(self, sequence, cache);
        let stats = stats?;
        let _ = sink.end();
        Ok(stats)
    }
}
