//! One answer read as chat output: [`Engine::chat_turn`] runs a generation and reads its text
//! with an [`OutputParser`], so that front ends (the server, `sluice chat`) get reasoning,
//! content and tool calls instead of raw text, and a stop sequence ends the generation with
//! [`FinishReason::StopSequence`](crate::FinishReason::StopSequence).

use std::ops::ControlFlow;

use sluice_backend::Backend;

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
        cache: Option<&mut PromptCache<B>>,
        request: &GenerateRequest<'_>,
        output: OutputOptions,
        mut on_event: impl FnMut(TurnEvent) -> ControlFlow<()>,
    ) -> Result<GenerationStats, EngineError> {
        let mut parser = OutputParser::new(output);
        let mut held = Vec::new();
        let stats = self.generate_cached(cache, request, |event| match event {
            TokenEvent::Token { id, text } => {
                let output = parser.push(text);
                let flow = on_event(TurnEvent::Token { id, output });
                if parser.stopped() {
                    ControlFlow::Break(Halt::StopSequence)
                } else if flow.is_break() {
                    ControlFlow::Break(Halt::Cancel)
                } else {
                    ControlFlow::Continue(())
                }
            }
            // Not a token: its output goes out with the parser's own held-back text.
            TokenEvent::Flush { text } => {
                held = parser.push(text);
                ControlFlow::Continue(())
            }
        })?;
        held.extend(parser.finish());
        let _ = on_event(TurnEvent::End { output: held });
        Ok(stats)
    }
}
