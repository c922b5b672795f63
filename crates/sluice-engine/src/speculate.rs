//! Speculative decoding: a cheap drafter guesses the next few tokens, and one forward pass of
//! the model over the last token and the guesses checks them all (the dense weights and each
//! routed expert read once for every row). The drafted tokens the model would have produced
//! are kept, and the model's own token at the first miss comes free with the pass.
//!
//! The check is exact for any sampler: row `i` of the pass is sampled as decoding would sample
//! it, and the draft is kept while the sample equals it. A drafter that proposes one token
//! (probability 1) is accepted with the model's probability of that token, and a miss leaves the
//! model's distribution without it, renormalised: the standard speculative-sampling rule for a
//! deterministic draft. Greedy decoding therefore produces the tokens it produces without
//! speculation (up to the order of summation of a multi-row pass).

use std::fmt;
use std::sync::Arc;

/// How a generation drafts tokens for the model to check.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Speculation {
    /// One token per forward pass.
    #[default]
    Off,
    /// Prompt lookup: where the last few tokens occurred before (in the prompt or the output so
    /// far), the tokens that followed them there, up to `draft_tokens`.
    Lookup { draft_tokens: usize },
    /// The engine's draft model ([`crate::Engine::load_draft`]), a smaller model with the same
    /// tokenizer, drafts `draft_tokens` greedily.
    Draft { draft_tokens: usize },
    /// The model's own multi-token-prediction layer (Qwen3.5's and Qwen3-Next's `mtp.*`),
    /// chained to draft `draft_tokens` greedily from the model's last hidden state.
    Mtp { draft_tokens: usize },
    /// For benchmarks: drafts `answer`, what the model generated after the first `after`
    /// tokens of this very prompt on an earlier run. Greedy decoding keeps every draft: the most
    /// any drafter can give at `draft_tokens` per pass. Not a setting of `generate` or `serve`.
    Replay {
        answer: Arc<[u32]>,
        after: usize,
        draft_tokens: usize,
    },
}

/// Drafted tokens per pass when `--draft-tokens` is not given.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// The same for the MTP layer: its chained drafts grow less likely past a few steps (on the demo,
/// prose, one H200: 90%, 94%, 89% and 73% kept at 2, 3, 4 and 6 drafts), and 3 was the fastest
/// there, with 4 within the run-to-run spread.
pub const DEFAULT_MTP_DRAFT_TOKENS: usize = 3;

/// The longest and shortest run of trailing tokens prompt lookup matches (longest first: a
/// longer match predicts better; a single token matches too often to be worth a pass).
const LOOKUP_NGRAM: std::ops::RangeInclusive<usize> = 2..=4;

impl Speculation {
    /// Parses `--speculate` with `--draft-tokens` (`None`: the default).
    pub fn from_args(method: &str, draft_tokens: Option<usize>) -> Result<Self, String> {
        let k = draft_count(draft_tokens)?;
        match method {
            "mtp" => Ok(Speculation::Mtp {
                draft_tokens: draft_tokens.map_or(DEFAULT_MTP_DRAFT_TOKENS, |_| k),
            }),
            "off" => Ok(Speculation::Off),
            "lookup" => Ok(Speculation::Lookup { draft_tokens: k }),
            "draft" => Ok(Speculation::Draft { draft_tokens: k }),
            other => Err(format!(
                "--speculate {other}: expected mtp, lookup, draft or off"
            )),
        }
    }

    /// `--speculate replay` of `bench`: [`Speculation::Replay`] with no answer yet (each run
    /// records its own).
    pub fn replay(draft_tokens: Option<usize>) -> Result<Self, String> {
        Ok(Speculation::Replay {
            answer: Arc::from([]),
            after: 0,
            draft_tokens: draft_count(draft_tokens)?,
        })
    }

    /// Tokens drafted per pass (0: off).
    pub fn draft_tokens(&self) -> usize {
        match *self {
            Speculation::Off => 0,
            Speculation::Lookup { draft_tokens }
            | Speculation::Draft { draft_tokens }
            | Speculation::Mtp { draft_tokens }
            | Speculation::Replay { draft_tokens, .. } => draft_tokens,
        }
    }

    /// Up to `limit` drafted tokens to follow `history` (empty: decode one token). A draft
    /// model's and the MTP layer's tokens come from the engine instead (empty here).
    pub fn draft(&self, history: &[u32], limit: usize) -> Vec<u32> {
        match *self {
            Speculation::Off | Speculation::Draft { .. } | Speculation::Mtp { .. } => Vec::new(),
            Speculation::Lookup { draft_tokens } => {
                lookup_draft(history, draft_tokens.min(limit), LOOKUP_NGRAM)
            }
            Speculation::Replay {
                ref answer,
                after,
                draft_tokens,
            } => {
                // `history` ends with the answer's tokens so far, the next one to run included.
                let made = history.len().saturating_sub(after);
                let rest = answer.get(made..).unwrap_or_default();
                rest[..rest.len().min(draft_tokens.min(limit))].to_vec()
            }
        }
    }
}

/// `--draft-tokens`, checked (`None`: the default).
fn draft_count(draft_tokens: Option<usize>) -> Result<usize, String> {
    match draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS) {
        k @ 1..=64 => Ok(k),
        k => Err(format!("--draft-tokens {k}: give 1 to 64")),
    }
}

impl fmt::Display for Speculation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Speculation::Off => write!(f, "off"),
            Speculation::Lookup { draft_tokens } => write!(f, "lookup, {draft_tokens} tokens"),
            Speculation::Draft { draft_tokens } => write!(f, "draft model, {draft_tokens} tokens"),
            Speculation::Mtp { draft_tokens } => write!(f, "mtp, {draft_tokens} tokens"),
            Speculation::Replay { draft_tokens, .. } => write!(f, "replay, {draft_tokens} tokens"),
        }
    }
}

/// Prompt lookup: finds the latest earlier occurrence of `history`'s last `n` tokens (the
/// largest `n` of `ngram` that occurs) and returns up to `k` tokens that followed it.
pub fn lookup_draft(history: &[u32], k: usize, ngram: std::ops::RangeInclusive<usize>) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    for n in ngram.rev() {
        if n == 0 || history.len() <= n {
            continue;
        }
        let tail = &history[history.len() - n..];
        // Latest first: recent text predicts best. The match must leave a token after it.
        let found = (0..history.len() - n)
            .rev()
            .find(|&at| &history[at..at + n] == tail);
        if let Some(at) = found {
            let from = at + n;
            return history[from..(from + k).min(history.len())].to_vec();
        }
    }
    Vec::new()
}

/// Counts of a generation's speculation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Forward passes that checked drafted tokens.
    pub passes: usize,
    /// Tokens drafted, and of them those the model kept.
    pub drafted: usize,
    pub accepted: usize,
    /// Tokens those passes produced (the kept drafts and one of the model's own each).
    pub produced: usize,
}

impl SpeculationStats {
    /// The share of drafted tokens the model kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Tokens per checking pass.
    pub fn tokens_per_pass(&self) -> f64 {
        self.produced as f64 / self.passes.max(1) as f64
    }

    pub fn add(&mut self, other: &SpeculationStats) {
        self.passes += other.passes;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.produced += other.produced;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_drafts_the_answer_after_the_tokens_made() {
        let replay = Speculation::Replay {
            answer: vec![10, 11, 12, 13].into(),
            after: 3,
            draft_tokens: 2,
        };
        // Prompt of 3, then the answer's first token about to run: drafts follow it.
        assert_eq!(replay.draft(&[1, 2, 3, 10], 8), vec![11, 12]);
        assert_eq!(replay.draft(&[1, 2, 3, 10, 11, 12], 8), vec![13]);
        assert_eq!(replay.draft(&[1, 2, 3, 10], 1), vec![11]);
        // Past the recorded answer: nothing.
        assert!(replay.draft(&[1, 2, 3, 10, 11, 12, 13, 14], 8).is_empty());
    }

    #[test]
    fn lookup_takes_the_latest_longest_match() {
        // "1 2 3 4 5 ... 1 2 3" continues with "4 5" (the only 3-token match).
        let h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(lookup_draft(&h, 2, 2..=4), vec![4, 5]);
        // Two matches of "7 8": the later one's continuation wins.
        let h = [7, 8, 1, 0, 7, 8, 2, 0, 7, 8];
        assert_eq!(lookup_draft(&h, 3, 2..=4), vec![2, 0, 7]);
        // A longer match wins over a later shorter one.
        let h = [5, 7, 8, 1, 6, 7, 8, 2, 5, 7, 8];
        assert_eq!(lookup_draft(&h, 1, 2..=4), vec![1]);
        // The continuation stops at the end of the history.
        let h = [3, 4, 3, 4];
        assert_eq!(lookup_draft(&h, 5, 2..=4), vec![3, 4]);
    }

    #[test]
    fn lookup_drafts_nothing_without_a_match() {
        assert!(lookup_draft(&[1, 2, 3, 4], 4, 2..=4).is_empty());
        assert!(lookup_draft(&[1], 4, 2..=4).is_empty());
        assert!(lookup_draft(&[], 4, 2..=4).is_empty());
        assert!(lookup_draft(&[1, 1, 1], 0, 2..=4).is_empty());
        // A single repeated token is not enough (the shortest match is 2).
        assert!(lookup_draft(&[1, 2, 1], 4, 2..=4).is_empty());
    }

    #[test]
    fn arguments_are_checked() {
        assert_eq!(
            Speculation::from_args("lookup", Some(3)),
            Ok(Speculation::Lookup { draft_tokens: 3 })
        );
        assert_eq!(Speculation::from_args("off", None), Ok(Speculation::Off));
        assert!(Speculation::from_args("lookup", Some(0)).is_err());
        assert_eq!(
            Speculation::from_args("mtp", Some(2)),
            Ok(Speculation::Mtp { draft_tokens: 2 })
        );
        assert_eq!(
            Speculation::from_args("mtp", None),
            Ok(Speculation::Mtp {
                draft_tokens: DEFAULT_MTP_DRAFT_TOKENS
            })
        );
        assert!(Speculation::from_args("medusa", None)
            .unwrap_err()
            .contains("expected mtp, lookup, draft or off"));
        assert_eq!(
            Speculation::from_args("draft", Some(5)),
            Ok(Speculation::Draft { draft_tokens: 5 })
        );
        assert_eq!(
            Speculation::Lookup { draft_tokens: 4 }.draft(&[1, 2, 3, 1, 2], 1),
            vec![3]
        );
    }
}
