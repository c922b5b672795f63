//! Saved request states, so a request that extends an earlier conversation skips recomputing the
//! part of its prompt the model has already seen.
//!
//! A chat client resends the whole conversation every turn: turn 2's prompt is turn 1's prompt,
//! turn 1's answer and the new user message. [`PromptCache`] keeps the model state (attention
//! KV caches and linear-attention recurrent states) of recent requests with the tokens it has
//! consumed; [`PromptCache::take`] hands back the state with the longest usable common prefix.
//!
//! Attention caches can be rewound to any shorter prefix; recurrent states cannot (they fold
//! every token into a fixed-size matrix), so for hybrid models (Qwen3.5) a state is reusable only
//! when its tokens are a whole prefix of the new prompt. That is why a generation saves two
//! snapshots for such models: the state right after the prompt (always a prefix of the next turn,
//! unless the template rewrites history, e.g. drops earlier reasoning) and the state at the end of
//! the answer.

use sluice_backend::Backend;
use sluice_models::State;

struct Entry<B: Backend> {
    /// The tokens `state` has consumed, in order.
    tokens: Vec<u32>,
    state: State<B>,
    /// Logits after the last token of `tokens`, when saved: lets a request whose prompt equals
    /// `tokens` start sampling with no forward pass at all.
    logits: Option<Vec<f32>>,
    last_used: u64,
}

/// A state taken from the cache to continue a prompt from.
pub struct Resumed<B: Backend> {
    pub state: State<B>,
    /// Prompt tokens already consumed by `state` (`state.position`).
    pub cached_tokens: usize,
    /// Logits after the last cached token, when the whole prompt was cached.
    pub logits: Option<Vec<f32>>,
}

/// A small LRU set of saved request states. Capacity 0 disables it.
pub struct PromptCache<B: Backend> {
    entries: Vec<Entry<B>>,
    capacity: usize,
    clock: u64,
}

impl<B: Backend> PromptCache<B> {
    /// A cache of at most `capacity` saved states (each holds a full KV cache and recurrent
    /// state, so keep it small for large models and long contexts).
    pub fn new(capacity: usize) -> Self {
        PromptCache {
            entries: Vec::new(),
            capacity,
            clock: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The saved state that covers the longest prefix of `prompt`: moved out of the cache when
    /// all of it is used (the caller saves its successor), a rewound copy otherwise. `None` when
    /// no saved state helps. At least one prompt token is always left to run unless the saved
    /// state also kept the logits of exactly this prompt.
    pub fn take(&mut self, backend: &B, prompt: &[u32]) -> Option<Resumed<B>> {
        let (index, usable) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, usable_prefix(e, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, self.entries[i].last_used))?;
        if usable < self.entries[index].tokens.len() {
            // Rewinding: work on a copy, so the longer state stays for a request that shares
            // more of it (a regenerated or edited turn often comes back to it).
            self.clock += 1;
            let entry = &mut self.entries[index];
            entry.last_used = self.clock;
            let mut state = entry.state.clone();
            if !state.rewind(backend, usable) {
                return None;
            }
            return Some(Resumed {
                state,
                cached_tokens: usable,
                logits: None,
            });
        }
        let mut entry = self.entries.swap_remove(index);
        let logits = if usable == prompt.len() {
            entry.logits.take()
        } else {
            None
        };
        Some(Resumed {
            state: entry.state,
            cached_tokens: usable,
            logits,
        })
    }

    /// Saves `state`, which has consumed exactly `tokens`, evicting the least recently used
    /// state when full. A saved state that is a prefix of the new one and cannot be used once
    /// the new one exists (same tokens) is replaced.
    pub fn insert(&mut self, tokens: Vec<u32>, state: State<B>, logits: Option<Vec<f32>>) {
        if self.capacity == 0 || tokens.is_empty() {
            return;
        }
        debug_assert_eq!(state.position, tokens.len());
        self.entries.retain(|e| e.tokens != tokens);
        if self.entries.len() >= self.capacity {
            if let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            {
                self.entries.swap_remove(oldest);
            }
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            state,
            logits,
            last_used: self.clock,
        });
    }
}

/// How many tokens of `prompt` the entry's state can stand for.
fn usable_prefix<B: Backend>(entry: &Entry<B>, prompt: &[u32]) -> usize {
    let common = entry
        .tokens
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let whole = common == entry.tokens.len();
    if whole && common == prompt.len() && entry.logits.is_some() {
        return common;
    }
    // Leave at least one token to run, so the forward pass produces the next logits.
    let limit = prompt.len().saturating_sub(1);
    if whole && common <= limit {
        return common;
    }
    if entry.state.can_rewind() {
        return common.min(limit);
    }
    0
}
