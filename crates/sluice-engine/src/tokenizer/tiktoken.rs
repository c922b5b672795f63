//! Kimi K2's tokenizer, which ships as `tiktoken.model` instead of a `tokenizer.json`.
//!
//! Moonshot's checkpoints (and mlx-community's conversions) hold `tiktoken.model` (one line per
//! token: base64 of its bytes, a space, its rank, which is its id), `tokenization_kimi.py`
//! (`TikTokenTokenizer`, loaded with `trust_remote_code`) and `tokenizer_config.json`. This
//! module encodes and decodes exactly as `TikTokenTokenizer` does through `tiktoken`:
//!
//! - **Special tokens.** The 256 ids after the ranks are special, named by
//!   `added_tokens_decoder` where it names them and `<|reserved_token_{id}|>` otherwise; other
//!   `added_tokens_decoder` entries above the ranks are added too. `encode` uses
//!   `allowed_special="all"`, so every one of them written in the text is its id (the chat
//!   template's `<|im_user|>` etc.), as added tokens are for `tokenizer.json` models. Where two
//!   could match at one place the longer wins (tiktoken's order there is a hash map's).
//! - **Chunks.** `TikTokenTokenizer.encode` cuts the text into 400,000-character chunks, and
//!   cuts each where a run of whitespace (Python's `str.isspace`) or of non-whitespace would
//!   pass 25,000 characters, and encodes the pieces one by one; so does this.
//! - **Pre-tokenization** by Kimi's `pat_str` ([`KIMI_PAT_PARTS`]), matched by the `regex`
//!   crate, which is the engine tiktoken itself runs (through `fancy-regex`, which hands it
//!   everything but look-around): the same leftmost-first semantics, the same Unicode tables
//!   (`\p{Han}` is Script=Han there and in Oniguruma, `\s` is White_Space), and it parses the
//!   class intersections `[...&&[^\p{Han}]]` as written. Only the look-ahead of `\s+(?!\S)` is
//!   not `regex` syntax; the last two alternatives are matched as `\s+` and the look-ahead is
//!   applied by hand (see [`Tiktoken::pieces`]).
//! - **BPE** with tiktoken's rank semantics: a piece that is a token is that token; otherwise
//!   start from its bytes and merge, again and again, the adjacent pair whose concatenation has
//!   the lowest rank (the leftmost of equals) until no concatenation is a token. A heap keeps
//!   this O(n log n) for long pieces; the choices are tiktoken's `byte_pair_merge`'s.
//! - **Decoding** concatenates the tokens' bytes and replaces invalid UTF-8 with U+FFFD, as
//!   `tiktoken`'s `decode` (errors="replace") and the `tokenizers` ByteLevel decoder do.
//!
//! Vocabulary strings ([`Tiktoken::token_id`], [`Tiktoken::id_to_token`]) are the tokens'
//! bytes through GPT-2's byte-to-unicode table, as `TikTokenTokenizer`'s `encoder` has them.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

use regex::Regex;

/// The BPE file of a tiktoken model directory.
pub const MODEL_FILE: &str = "tiktoken.model";
/// Where the special tokens are named.
pub const CONFIG_FILE: &str = "tokenizer_config.json";
/// `TikTokenTokenizer.num_reserved_special_tokens`: special ids after the ranks.
pub const NUM_RESERVED_SPECIAL_TOKENS: u32 = 256;
/// `TikTokenTokenizer.encode`: the text is encoded in chunks of this many characters.
const MAX_ENCODE_CHARS: usize = 400_000;
/// ... each cut where whitespace or non-whitespace runs longer than this.
const MAX_NO_WHITESPACES_CHARS: usize = 25_000;

/// The alternatives of `TikTokenTokenizer.pat_str` in moonshotai's `tokenization_kimi.py`
/// (Kimi K2; the same in llama.cpp's `LLAMA_VOCAB_PRE_TYPE_KIMI_K2` and vLLM), verbatim;
/// joined with `|` they are the pattern.
pub const KIMI_PAT_PARTS: [&str; 8] = [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
];

/// Kimi's `pat_str`.
pub fn kimi_pat_str() -> String {
    KIMI_PAT_PARTS.join("|")
}

/// The pattern as `regex` runs it: the first six alternatives, then `\s+` for the last two
/// (`\s+(?!\S)|\s+`), whose look-ahead [`Tiktoken::pieces`] applies.
fn regex_pattern() -> String {
    let mut parts = KIMI_PAT_PARTS[..6].to_vec();
    parts.push(r"\s+");
    parts.join("|")
}

/// An added (special) token.
#[derive(Debug, Clone)]
pub(crate) struct Added {
    pub content: String,
    pub id: u32,
    pub special: bool,
}

/// A tiktoken BPE with Kimi's pattern and special tokens.
pub(crate) struct Tiktoken {
    /// Token bytes → rank (= id).
    ranks: HashMap<Vec<u8>, u32>,
    /// Id → bytes, for the ranks and the added tokens.
    bytes_of: HashMap<u32, Vec<u8>>,
    added: Vec<Added>,
    added_ids: HashMap<String, u32>,
    /// Every added token, longest first; `None` when there are none.
    added_re: Option<Regex>,
    pieces: Regex,
    /// One past the highest id (tiktoken's `n_vocab`).
    n_vocab: usize,
}

impl Tiktoken {
    /// Loads `dir/tiktoken.model` and the special tokens of `dir/tokenizer_config.json` (absent:
    /// all 256 reserved names). Errors name the file (and the line) at fault.
    pub fn from_dir(dir: &Path) -> Result<Self, (std::path::PathBuf, String)> {
        let model_path = dir.join(MODEL_FILE);
        let bytes = std::fs::read(&model_path).map_err(|e| (model_path.clone(), e.to_string()))?;
        let ranks = parse_model(&bytes).map_err(|m| (model_path.clone(), m))?;
        let config_path = dir.join(CONFIG_FILE);
        let named = match std::fs::read(&config_path) {
            Ok(b) => parse_added_tokens(&b).map_err(|m| (config_path.clone(), m))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err((config_path, e.to_string())),
        };
        Self::new(ranks, named).map_err(|m| (config_path, m))
    }

    /// `ranks` as `tiktoken.model` gives them; `named`: `added_tokens_decoder`'s entries.
    pub fn new(ranks: HashMap<Vec<u8>, u32>, named: Vec<Added>) -> Result<Self, String> {
        let n_base = u32::try_from(ranks.len()).map_err(|_| "too many tokens".to_string())?;
        let mut bytes_of: HashMap<u32, Vec<u8>> =
            ranks.iter().map(|(b, &r)| (r, b.clone())).collect();
        let mut by_id: std::collections::BTreeMap<u32, Added> = (n_base
            ..n_base.saturating_add(NUM_RESERVED_SPECIAL_TOKENS))
            .map(|id| {
                let content = format!("<|reserved_token_{id}|>");
                (
                    id,
                    Added {
                        content,
                        id,
                        special: true,
                    },
                )
            })
            .collect();
        for a in named {
            if let Some(b) = bytes_of.get(&a.id) {
                return Err(format!(
                    "added token {:?} has id {}, which {MODEL_FILE} gives to the BPE token {:?}",
                    a.content,
                    a.id,
                    String::from_utf8_lossy(b)
                ));
            }
            if a.content.is_empty() {
                return Err(format!("added token {} is empty", a.id));
            }
            by_id.insert(a.id, a);
        }
        let added: Vec<Added> = by_id.into_values().collect();
        // Later ids win a shared name, as in Python's dict built in id order.
        let added_ids: HashMap<String, u32> =
            added.iter().map(|a| (a.content.clone(), a.id)).collect();
        for a in &added {
            bytes_of.insert(a.id, a.content.as_bytes().to_vec());
        }
        let added_re = if added.is_empty() {
            None
        } else {
            let mut names: Vec<&str> = added_ids.keys().map(String::as_str).collect();
            names.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
            let alt: Vec<String> = names.iter().map(|s| regex::escape(s)).collect();
            Some(
                regex::RegexBuilder::new(&alt.join("|"))
                    .size_limit(1 << 26)
                    .build()
                    .map_err(|e| format!("special tokens: {e}"))?,
            )
        };
        let pieces = Regex::new(&regex_pattern()).map_err(|e| format!("pattern: {e}"))?;
        let n_vocab = bytes_of.keys().max().map_or(0, |&m| m as usize + 1);
        Ok(Tiktoken {
            ranks,
            bytes_of,
            added,
            added_ids,
            added_re,
            pieces,
            n_vocab,
        })
    }

    pub fn added(&self) -> &[Added] {
        &self.added
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// `TikTokenTokenizer.encode(text)`: chunks, special tokens recognised, BPE.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for part in split_runs(chunk, MAX_NO_WHITESPACES_CHARS) {
                self.encode_with_specials(part, &mut out);
            }
        }
        out
    }

    /// tiktoken's `encode(text, allowed_special="all")`: the text between special tokens is
    /// pre-tokenized on its own (a look-ahead at its end sees the end of text).
    fn encode_with_specials(&self, text: &str, out: &mut Vec<u32>) {
        let mut start = 0;
        loop {
            let next = self
                .added_re
                .as_ref()
                .and_then(|re| re.find_at(text, start));
            let end = next.map_or(text.len(), |m| m.start());
            self.pieces(&text[start..end], |piece| self.bpe(piece.as_bytes(), out));
            match next {
                Some(m) => {
                    out.extend(self.added_ids.get(m.as_str()).copied());
                    start = m.end();
                }
                None => break,
            }
        }
    }

    /// Calls `f` with each match of Kimi's pattern in `text`, in order.
    ///
    /// `regex` matches `\s+` where the pattern has `\s+(?!\S)|\s+`. Those two are reached only
    /// by whitespace that no earlier alternative takes: a run (the whole rest of the run, as
    /// `\s+` is greedy) without `\r` or `\n` (else `\s*[\r\n]+` would match). A backtracking
    /// engine then tries `\s+(?!\S)`: the run followed by the end of text matches whole; followed
    /// by a non-space, it gives back its last character if it has two or more (leaving the
    /// space to start the next piece, e.g. `" word"`), and with one `\s+` takes it. So: a
    /// match of whitespace alone, without `\r`/`\n`, of two or more characters, not at the end,
    /// loses its last character. (Every other alternative holds a non-space or a newline.)
    pub fn pieces<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut at = 0;
        while let Some(m) = self.pieces.find_at(text, at) {
            let s = m.as_str();
            let mut end = m.end();
            if end < text.len()
                && s.chars()
                    .all(|c| c.is_whitespace() && c != '\r' && c != '\n')
            {
                let mut cs = s.char_indices();
                if let (Some(_), Some((last, _))) = (cs.next(), cs.next_back()) {
                    end = m.start() + last;
                }
            }
            f(&text[m.start()..end]);
            at = end;
        }
    }

    /// tiktoken's `byte_pair_encode` of one piece (the whole piece when it is a token).
    fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        let n = piece.len();
        let rank = |s: usize, e: usize| self.ranks.get(&piece[s..e]).copied();
        // Parts are byte ranges; a part is named by its start. `next[s]` is where the part at
        // `s` ends (the next part's start), `prev[s]` the start of the part before it.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        // (rank of the pair's bytes, start of its left part, end of its right part); an entry
        // is current while its left part lives and still spans to the same end with its right
        // neighbour (parts only grow, so the same span means the same pair).
        let mut heap = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some(r) = rank(i, i + 2) {
                heap.push(Reverse((r, i, i + 2)));
            }
        }
        while let Some(Reverse((_, s, e))) = heap.pop() {
            if !alive[s] || next[s] >= n || next[next[s]] != e {
                continue;
            }
            let m = next[s];
            alive[m] = false;
            next[s] = e;
            if e < n {
                prev[e] = s;
                if let Some(r) = rank(s, next[e]) {
                    heap.push(Reverse((r, s, next[e])));
                }
            }
            let p = prev[s];
            if p != usize::MAX {
                if let Some(r) = rank(p, e) {
                    heap.push(Reverse((r, p, e)));
                }
            }
        }
        let mut s = 0;
        while s < n {
            // Every part is a single byte (all have ranks, checked at load) or a merge of two
            // tokens into a token.
            out.extend(rank(s, next[s]));
            s = next[s];
        }
    }

    /// The text of `ids`: their bytes concatenated, invalid UTF-8 replaced by U+FFFD; unknown
    /// ids skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for id in ids {
            if let Some(b) = self.bytes_of.get(id) {
                bytes.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The id of an added token's content, or of a token's byte-level (GPT-2) string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.added_ids.get(token) {
            return Some(id);
        }
        let bytes: Option<Vec<u8>> = token.chars().map(char_byte).collect();
        self.ranks.get(&bytes?).copied()
    }

    /// An added token's content, or a BPE token's bytes as a byte-level (GPT-2) string.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        if let Some(a) = self.added.iter().find(|a| a.id == id) {
            return Some(a.content.clone());
        }
        let b = self.bytes_of.get(&id)?;
        Some(b.iter().map(|&b| byte_char(b)).collect())
    }
}

/// Python's `str.isspace`: White_Space, and U+001C..U+001F (bidi class B or S).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `text` in pieces of `n` characters (the last shorter); none for empty text.
fn char_chunks(text: &str, n: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = rest.char_indices().nth(n).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}

/// `TikTokenTokenizer._split_whitespaces_or_nonwhitespaces(s, max_len)`.
fn split_runs(s: &str, max_len: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run = 0usize;
    let mut run_is_space = s.chars().next().is_some_and(py_isspace);
    let mut start = 0;
    for (i, c) in s.char_indices() {
        let space = py_isspace(c);
        if space != run_is_space {
            run = 1;
            run_is_space = space;
        } else {
            run += 1;
            if run > max_len {
                out.push(&s[start..i]);
                start = i;
                run = 1;
            }
        }
    }
    out.push(&s[start..]);
    out
}

/// GPT-2's printable bytes, which stand for themselves in byte-level strings.
fn printable(b: u8) -> bool {
    (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE
}

/// GPT-2's `bytes_to_unicode`: printable bytes as themselves, the others as U+0100 on.
fn byte_char(b: u8) -> char {
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('\u{FFFD}')
}

/// The inverse of [`byte_char`].
fn char_byte(c: char) -> Option<u8> {
    let u = c as u32;
    match u8::try_from(u) {
        Ok(b) if printable(b) => Some(b),
        Ok(_) => None,
        Err(_) => {
            let n = u.checked_sub(256)? as usize;
            (0..=255u8).filter(|&x| !printable(x)).nth(n)
        }
    }
}

/// Parses `tiktoken.model` as `tiktoken.load.load_tiktoken_bpe` does (blank lines skipped),
/// more strictly: every line two fields, the token in standard padded base64, the rank a
/// decimal u32, no rank or token twice, and every single byte a token.
fn parse_model(bytes: &[u8]) -> Result<HashMap<Vec<u8>, u32>, String> {
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
    let mut line_of_rank: HashMap<u32, usize> = HashMap::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let n = i + 1;
        let text = String::from_utf8_lossy(line);
        let fields: Vec<&str> = text.split_ascii_whitespace().collect();
        let (tok, rank) = match fields[..] {
            [] => continue,
            [tok, rank] => (tok, rank),
            _ => {
                return Err(format!(
                    "line {n}: expected `<base64 token> <rank>`, found {:?}",
                    shorten(&text)
                ))
            }
        };
        let token = base64_decode(tok)
            .map_err(|e| format!("line {n}: token {:?} is not base64: {e}", shorten(tok)))?;
        if token.is_empty() {
            return Err(format!("line {n}: empty token"));
        }
        let rank: u32 = match rank.parse() {
            Ok(r) if rank.bytes().all(|b| b.is_ascii_digit()) => r,
            _ => {
                return Err(format!(
                    "line {n}: rank {:?} is not a number (0 to {})",
                    shorten(rank),
                    u32::MAX
                ))
            }
        };
        if let Some(first) = line_of_rank.insert(rank, n) {
            return Err(format!(
                "line {n}: rank {rank} is given twice (first on line {first})"
            ));
        }
        if let Some(r) = ranks.insert(token, rank) {
            return Err(format!(
                "line {n}: token {tok} is given twice (first with rank {r})"
            ));
        }
    }
    if ranks.is_empty() {
        return Err("no tokens".to_string());
    }
    if let Some(b) = (0..=255u8).find(|b| !ranks.contains_key(&[*b][..])) {
        return Err(format!(
            "no token for the byte 0x{b:02x} (a byte-level BPE needs all 256)"
        ));
    }
    Ok(ranks)
}

fn shorten(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Standard base64 (RFC 4648 alphabet, `=` padding to a multiple of 4).
fn base64_decode(s: &str) -> Result<Vec<u8>, String> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return Err(format!("length {} is not a multiple of 4", b.len()));
    }
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    for (q, quad) in b.chunks(4).enumerate() {
        let last = q + 1 == b.len() / 4;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return Err("misplaced `=` padding".to_string());
        }
        let mut acc = 0u32;
        for (j, &c) in quad[..4 - pad].iter().enumerate() {
            let v = val(c)
                .ok_or_else(|| format!("invalid character {:?} at {}", char::from(c), q * 4 + j))?;
            acc |= v << (18 - 6 * j);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Ok(out)
}

/// `added_tokens_decoder` of tokenizer_config.json (absent: none).
fn parse_added_tokens(bytes: &[u8]) -> Result<Vec<Added>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let Some(obj) = v.as_object() else {
        return Err("expected a JSON object".to_string());
    };
    let Some(dec) = obj.get("added_tokens_decoder") else {
        return Ok(Vec::new());
    };
    let Some(dec) = dec.as_object() else {
        return Err("`added_tokens_decoder` is not an object".to_string());
    };
    let mut out = Vec::new();
    for (key, t) in dec {
        let id: u32 = key
            .parse()
            .map_err(|_| format!("`added_tokens_decoder` key {key:?} is not a token id"))?;
        let content = t
            .get("content")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| format!("`added_tokens_decoder` entry {key} has no `content` string"))?;
        let special = t
            .get("special")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        out.push(Added {
            content: content.to_string(),
            id,
            special,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of all bytes plus `extra` (ranks in order).
    fn tk(extra: &[&[u8]], named: Vec<Added>) -> Tiktoken {
        let mut ranks: HashMap<Vec<u8>, u32> = (0..=255u8).map(|b| (vec![b], b as u32)).collect();
        for t in extra {
            let n = ranks.len() as u32;
            ranks.entry(t.to_vec()).or_insert(n);
        }
        Tiktoken::new(ranks, named).unwrap()
    }

    fn pieces(t: &Tiktoken, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        t.pieces(s, |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn pattern_parses_and_splits_like_tiktoken() {
        let t = tk(&[], Vec::new());
        // `\s+(?!\S)`: a run before a word gives its last space to the word; a single space,
        // a tab before punctuation and a run at the end stay whole.
        assert_eq!(pieces(&t, "a  b"), ["a", " ", " b"]);
        assert_eq!(pieces(&t, "a b"), ["a", " b"]);
        assert_eq!(pieces(&t, "a\t!"), ["a", "\t", "!"]);
        assert_eq!(pieces(&t, "a \t !"), ["a", " \t", " !"]);
        assert_eq!(pieces(&t, "end   "), ["end", "   "]);
        assert_eq!(pieces(&t, "a  \n  b"), ["a", "  \n", " ", " b"]);
        // Han runs alone; letters around them are other pieces; CJK punctuation is not Han.
        assert_eq!(pieces(&t, "GPT模型test。"), ["GPT", "模型", "test", "。"]);
        // Digits in threes; contractions, any case, stay with the word.
        assert_eq!(pieces(&t, "12345 IT'S"), ["123", "45", " IT'S"]);
        assert_eq!(pieces(&t, "HTTPServer"), ["HTTPServer"]);
        assert_eq!(
            pieces(&t, "x\u{3000}\u{2028}y"),
            ["x", "\u{3000}", "\u{2028}y"]
        );
        assert_eq!(
            kimi_pat_str(),
            r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        );
    }

    /// tiktoken's `byte_pair_merge`, as written there (quadratic), for comparison.
    fn reference_bpe(ranks: &HashMap<Vec<u8>, u32>, piece: &[u8]) -> Vec<u32> {
        if let Some(&r) = ranks.get(piece) {
            return vec![r];
        }
        let mut parts: Vec<usize> = (0..=piece.len()).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..parts.len().saturating_sub(2) {
                if let Some(&r) = ranks.get(&piece[parts[i]..parts[i + 2]]) {
                    if best.is_none_or(|(b, _)| r < b) {
                        best = Some((r, i));
                    }
                }
            }
            match best {
                Some((_, i)) => {
                    parts.remove(i + 1);
                }
                None => break,
            }
        }
        parts
            .windows(2)
            .map(|w| ranks[&piece[w[0]..w[1]]])
            .collect()
    }

    #[test]
    fn heap_bpe_equals_tiktokens_merge_order() {
        // A small alphabet and many multi-byte tokens, with ranks that disagree with any merge
        // order (tokens whose halves have higher ranks, equal concatenations by two splits).
        let mut seed = 12345u64;
        let mut rnd = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let word = |rnd: &mut dyn FnMut(u64) -> u64, len: u64| -> Vec<u8> {
            (0..len).map(|_| b'a' + rnd(3) as u8).collect()
        };
        let extra: Vec<Vec<u8>> = (0..300)
            .map(|_| {
                let len = 2 + rnd(5);
                word(&mut rnd, len)
            })
            .collect();
        let refs: Vec<&[u8]> = extra.iter().map(Vec::as_slice).collect();
        let t = tk(&refs, Vec::new());
        for _ in 0..2000 {
            let len = 1 + rnd(40);
            let w = word(&mut rnd, len);
            let mut got = Vec::new();
            t.bpe(&w, &mut got);
            assert_eq!(
                got,
                reference_bpe(&t.ranks, &w),
                "{:?}",
                String::from_utf8(w)
            );
        }
    }

    #[test]
    fn byte_level_strings() {
        let t = tk(&[b" h", b" hi"], Vec::new());
        assert_eq!(t.token_id("Ġhi"), Some(257));
        assert_eq!(t.id_to_token(257).as_deref(), Some("Ġhi"));
        assert_eq!(t.id_to_token(10).as_deref(), Some("Ċ"));
        assert_eq!(t.token_id("Ċ"), Some(10));
        assert_eq!(t.token_id("nope"), None);
        for b in 0..=255u8 {
            assert_eq!(char_byte(byte_char(b)), Some(b));
        }
        assert_eq!(char_byte('\u{144}'), None);
        assert_eq!(t.token_id("<|reserved_token_258|>"), Some(258));
        assert_eq!(t.n_vocab(), 258 + 256);
    }

    #[test]
    fn python_isspace_and_runs() {
        let py: Vec<u32> = vec![
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000,
            0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028,
            0x2029, 0x202f, 0x205f, 0x3000,
        ];
        let ours: Vec<u32> = (0..=0x10FFFFu32)
            .filter_map(char::from_u32)
            .filter(|&c| py_isspace(c))
            .map(|c| c as u32)
            .collect();
        assert_eq!(
            ours, py,
            "Python 3's [c for c in range(0x110000) if chr(c).isspace()]"
        );
        assert_eq!(split_runs("aaaaa  b", 2), ["aa", "aa", "a  b"]);
        assert_eq!(split_runs("", 2), [""]);
        assert_eq!(
            char_chunks("ab中cd", 2).collect::<Vec<_>>(),
            ["ab", "中c", "d"]
        );
        assert_eq!(char_chunks("", 2).count(), 0);
    }

    #[test]
    fn base64() {
        assert_eq!(base64_decode("IQ==").unwrap(), b"!");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("5Lit5paH").unwrap(), "中文".as_bytes());
        assert_eq!(base64_decode("/+8=").unwrap(), [0xff, 0xef]);
        assert!(base64_decode("IQ=").is_err());
        assert!(base64_decode("I===").is_err());
        assert!(base64_decode("IQ==IQ==").is_err());
        assert!(base64_decode("I*==").is_err());
    }
}
