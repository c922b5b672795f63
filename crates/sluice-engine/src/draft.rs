//! Draft models (`--speculate draft --draft-model DIR`): a smaller model with the same
//! tokenizer guesses the next few tokens greedily, one cheap decode step each, and the engine's
//! model checks them all in one pass (see [`crate::speculate`]).
//!
//! Each sequence keeps its own draft state. It follows the sequence lazily: before drafting, the
//! draft state is taken back to the longest prefix it shares with the sequence's tokens (its
//! own drafts the model refused are dropped) and then runs the tokens it has not seen, in one
//! pass. A draft state that fell behind (the sequence decoded beside others, or drafting was
//! paused after misses) therefore catches up by itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_models::{CausalLm, Checkpoint, State};

use crate::tokenizer::Tokenizer;
use crate::{Engine, EngineError, LoadOptions};

/// A loaded draft model.
pub struct DraftModel<B: Backend> {
    pub path: PathBuf,
    pub model: Box<dyn CausalLm<B>>,
    /// Tokens per pass when a draft state catches up with a long prompt.
    prefill_chunk: usize,
}

/// One sequence's draft state.
pub(crate) struct Drafting<B: Backend> {
    state: State<B>,
    /// The tokens in `state`, in order.
    fed: Vec<u32>,
    /// A recurrent draft state before the last round's drafted tokens ran: what it goes back to
    /// when the model refuses some of them (an attention-only state is rewound instead).
    checkpoint: Option<Checkpoint<B>>,
}

impl<B: Backend + 'static> DraftModel<B> {
    /// Loads `path` on `backend` to draft for `main`, whose tokenizer it must share (same
    /// vocabulary, token for token).
    pub fn load(
        path: &Path,
        backend: Arc<B>,
        opts: &LoadOptions,
        main: &Engine<B>,
    ) -> Result<Self, EngineError> {
        let draft = Engine::load(path, backend, opts)
            .map_err(|e| EngineError::Input(format!("--draft-model {}: {e}", path.display())))?;
        same_vocabulary(&main.tokenizer, &draft.tokenizer).map_err(|why| {
            EngineError::Input(format!(
                "--draft-model {}: {why}; a draft model must share the model's tokenizer \
                 (a smaller model of the same family, e.g. Qwen3-0.6B for Qwen3-30B-A3B)",
                path.display()
            ))
        })?;
        Ok(DraftModel {
            path: path.to_path_buf(),
            model: draft.model,
            prefill_chunk: draft.prefill_chunk,
        })
    }

    /// Up to `k` tokens the draft model expects after `history` (whose last token the model
    /// runs next), chosen greedily; fewer where it would pick an id past `vocab` (the model's
    /// tokenizer) or an end token (`stop`). `drafting` is the sequence's draft state, made here
    /// on first use.
    pub(crate) fn draft(
        &self,
        drafting: &mut Option<Drafting<B>>,
        history: &[u32],
        k: usize,
        vocab: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        // Past the draft model's context there is nothing to draft with: plain decoding goes on.
        let k = k.min(self.model.info().max_context.saturating_sub(history.len()));
        if history.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let backend = self.model.backend();
        let d = match drafting {
            Some(d) => d,
            None => drafting.insert(Drafting {
                state: self.model.new_state()?,
                fed: Vec::new(),
                checkpoint: None,
            }),
        };
        // Keep what the state shares with the history, less at least its last token (its
        // logits give the first draft).
        let shared = d
            .fed
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = shared.min(history.len() - 1);
        self.go_back(d, keep)?;
        let mut out = None;
        for chunk in history[d.fed.len()..].chunks(self.prefill_chunk.max(1)) {
            out = Some(self.model.forward(&mut d.state, chunk, false)?);
            d.fed.extend_from_slice(chunk);
        }
        let mut logits = out.expect("at least the history's last token runs");
        // Drafted tokens may be refused: a recurrent state is copied before they run.
        if !d.state.can_rewind() {
            d.checkpoint = Some(d.state.checkpoint());
        }
        let mut drafts = Vec::with_capacity(k);
        loop {
            let token = backend.argmax_rows(&logits)?[0];
            if token as usize >= vocab || stop.contains(&token) {
                break;
            }
            drafts.push(token);
            if drafts.len() == k {
                break;
            }
            logits = self.model.forward(&mut d.state, &[token], false)?;
            d.fed.push(token);
        }
        Ok(drafts)
    }

    /// Takes `d` back to its first `keep` tokens, or to none when a recurrent state has no
    /// checkpoint there.
    fn go_back(&self, d: &mut Drafting<B>, keep: usize) -> Result<(), EngineError> {
        let checkpoint = d.checkpoint.take();
        if d.fed.len() <= keep {
            return Ok(());
        }
        let backend = self.model.backend();
        let back = match checkpoint {
            _ if d.state.can_rewind() => d.state.rewind(backend, keep),
            Some(c) if c.position() <= keep => {
                let kept = &d.fed[c.position()..keep];
                self.model.take_back(&mut d.state, c, kept)?
            }
            // Behind the checkpoint (or none): start over, the next round catches up.
            _ => {
                d.state = self.model.new_state()?;
                d.fed.clear();
                return Ok(());
            }
        };
        if !back {
            return Err(EngineError::Input(
                "the draft model's state could not be taken back".into(),
            ));
        }
        d.fed.truncate(keep);
        Ok(())
    }
}

/// Why two tokenizers are not interchangeable, if they are not: a different size, or the first
/// id whose token differs.
pub fn same_vocabulary(main: &Tokenizer, draft: &Tokenizer) -> Result<(), String> {
    let (n, m) = (main.vocab_size(), draft.vocab_size());
    if n != m {
        return Err(format!(
            "its tokenizer has {m} tokens and the model's has {n}"
        ));
    }
    for id in 0..n as u32 {
        let (a, b) = (main.id_to_token(id), draft.id_to_token(id));
        if a != b {
            return Err(format!(
                "token {id} is {b:?} in its tokenizer and {a:?} in the model's"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_cpu::{CpuBackend, Kernels};

    fn engine(fixture: &str, backend: &Arc<CpuBackend>) -> Engine<CpuBackend> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(fixture);
        Engine::load(&dir, backend.clone(), &LoadOptions::default()).unwrap()
    }

    /// The next-token logits of `state` against those of a fresh state that ran `tokens`.
    fn agrees(draft: &DraftModel<CpuBackend>, state: &mut State<CpuBackend>, tokens: &[u32]) {
        let (m, b) = (&draft.model, draft.model.backend());
        let mut fresh = m.new_state().unwrap();
        m.forward(&mut fresh, tokens, false).unwrap();
        let want = b
            .to_host(&m.forward(&mut fresh, &[7], false).unwrap())
            .unwrap();
        let got = b.to_host(&m.forward(state, &[7], false).unwrap()).unwrap();
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let diff = want
            .iter()
            .zip(&got)
            .fold(0f32, |a, (w, g)| a.max((w - g).abs()));
        assert!(diff <= 1e-4 * scale, "max |diff| {diff} of {scale}");
    }

    /// Whatever the model keeps of each round (all, some, none, after a pause), the draft state
    /// holds exactly the history and the drafts that ran, for a recurrent draft model (taken
    /// back to its checkpoint) and an attention-only one (rewound).
    #[test]
    fn the_draft_state_follows_the_history() {
        let backend = Arc::new(CpuBackend::with_kernels(Kernels::Exact));
        let main = engine("qwen3_moe-q4", &backend);
        for fixture in ["qwen3_5_moe-q4", "qwen3_moe-q8"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures")
                .join(fixture);
            let draft =
                DraftModel::load(&path, backend.clone(), &LoadOptions::default(), &main).unwrap();
            let vocab = draft.model.info().vocab_size;
            let mut drafting = None;
            let mut history: Vec<u32> = (0..9).map(|i| 3 + 17 * i).collect();
            // How many of each round's drafts the model keeps, and the token it adds.
            for (kept, own) in [(2, 401), (0, 55), (4, 9), (1, 300), (3, 77)] {
                let drafts = draft.draft(&mut drafting, &history, 4, vocab, &[]).unwrap();
                assert_eq!(drafts.len(), 4, "{fixture}");
                let d = drafting.as_ref().unwrap();
                // The state ran the history and every draft but the last.
                assert_eq!(d.fed, [&history[..], &drafts[..3]].concat(), "{fixture}");
                history.extend_from_slice(&drafts[..kept]);
                history.push(own);
            }
            // A round without drafting (a pause after misses): the state catches up.
            history.extend([12, 13, 14]);
            let drafts = draft.draft(&mut drafting, &history, 2, vocab, &[]).unwrap();
            let d = drafting.as_mut().unwrap();
            let fed = [&history[..], &drafts[..1]].concat();
            assert_eq!(d.fed, fed, "{fixture}");
            agrees(&draft, &mut d.state, &fed);
            // Drafts stop at an end token.
            let mut none = None;
            let first = draft.draft(&mut none, &history, 1, vocab, &[]).unwrap()[0];
            assert!(draft
                .draft(&mut none, &history, 3, vocab, &[first])
                .unwrap()
                .is_empty());
        }
    }

    #[test]
    fn a_draft_model_with_another_tokenizer_is_refused() {
        let backend = Arc::new(CpuBackend::new());
        let main = engine("qwen3_moe-q4", &backend);
        let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
        let err = DraftModel::load(&demo, backend.clone(), &LoadOptions::default(), &main)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("--draft-model") && err.contains("8192 tokens") && err.contains("500"),
            "{err}"
        );
    }
}
