//! Drafting with the model's own multi-token-prediction layer (`--speculate mtp`): Qwen3.5's and
//! Qwen3-Next's `mtp.*`, trained beside the model to predict the token after next from the
//! model's final hidden state and the next token. Chained on its own output it drafts several
//! tokens, one small layer each, and the model checks them all in one pass
//! ([`crate::speculate`]).
//!
//! The layer has its own attention cache, one row per position of the sequence: row `p` pairs
//! the model's hidden state at `p` (kept by the sequence's state, [`State::keep_hidden`]) with
//! the token at `p + 1`. Before each round the rows whose inputs are now known (the positions
//! the model ran since) replace the chained rows of the last round's drafts, so the cache is
//! always what the layer would have seen running beside the model from the start. Positions
//! whose hidden state the model did not keep (a prompt resumed from the prompt cache) get zeros
//! in its place: their drafts are worse, never the output.

use sluice_backend::Backend;
use sluice_models::{CausalLm, State};

use crate::EngineError;

/// One sequence's MTP state.
pub(crate) struct MtpDrafting<B: Backend> {
    state: State<B>,
    /// Rows before this position ran on the model's hidden states and the sequence's tokens;
    /// the ones after are the last round's chained drafts.
    exact: usize,
}

/// Up to `k` tokens `model`'s MTP layer expects after `history`, whose last token the model runs next
/// (`main` has run the others, keeping their hidden states), chosen greedily; fewer where it
/// would pick an end token (`stop`). `drafting` is the sequence's MTP state, made here on
/// first use; the rows of the model's hidden states it has read are dropped from `main`.
pub(crate) fn draft<B: Backend>(
    model: &dyn CausalLm<B>,
    drafting: &mut Option<MtpDrafting<B>>,
    main: &mut State<B>,
    history: &[u32],
    k: usize,
    stop: &[u32],
    chunk: usize,
) -> Result<Vec<u32>, EngineError> {
    let (backend, position) = (model.backend(), main.position);
    let Some(mtp) = model.mtp()? else {
        return Ok(Vec::new());
    };
    let Some(hidden) = &main.hidden else {
        return Ok(Vec::new());
    };
    if k == 0 || position == 0 || history.len() != position + 1 {
        return Ok(Vec::new());
    }
    let width = mtp.hidden_size();
    // The latest hidden state must be the model's own (older gaps are filled with zeros); rows
    // past `position` are of drafts the model refused, dropped by its next pass.
    if hidden.covered(backend).end < position {
        return Ok(Vec::new());
    }
    let d = match drafting {
        Some(d) => d,
        None => drafting.insert(MtpDrafting {
            state: mtp.new_state()?,
            exact: 0,
        }),
    };
    // Back to the exact rows, less at least the last (its logits give the first draft).
    let start = d.exact.min(position - 1);
    if !d.state.rewind(backend, start) {
        return Err(EngineError::Input(
            "the MTP layer's state could not be rewound".into(),
        ));
    }
    let mut last = None;
    let mut at = start;
    while at < position {
        let end = (at + chunk.max(1)).min(position);
        let rows = hidden_rows(backend, main, at..end, width);
        last = Some(mtp.forward(&mut d.state, &rows, &history[at + 1..end + 1], false)?);
        at = end;
    }
    d.exact = position;
    if let Some(h) = &mut main.hidden {
        h.forget_before(backend, position);
    }
    let (mut logits, mut out) = last.expect("at least the last position runs");
    let mut drafts = Vec::with_capacity(k);
    loop {
        let token = backend.argmax_rows(&logits)?[0];
        if stop.contains(&token) {
            break;
        }
        drafts.push(token);
        if drafts.len() == k {
            break;
        }
        let g = backend.slice_rows(&out, backend.shape(&out).0 - 1, 1);
        (logits, out) = mtp.forward(&mut d.state, &g, &[token], false)?;
    }
    Ok(drafts)
}

/// The model's hidden states (`width` values each) at `range`, zeros where it did not keep them.
fn hidden_rows<B: Backend>(
    backend: &B,
    main: &State<B>,
    range: std::ops::Range<usize>,
    width: usize,
) -> B::Act {
    let kept = main.hidden.as_ref().and_then(|log| {
        let split = log.covered(backend).start.clamp(range.start, range.end);
        Some((split, log.rows(backend, split..range.end)?))
    });
    match kept {
        Some((split, rows)) if split == range.start => rows,
        Some((split, rows)) => {
            let zeros = backend.zeros(split - range.start, width);
            backend.concat_rows(&[&zeros, &rows])
        }
        None => backend.zeros(range.len(), width),
    }
}
