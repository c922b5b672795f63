//! `sluice perplexity`: a model's perplexity on a text, window by window, and how far other KV
//! cache formats move its predictions from the one it runs with (mean KL divergence, argmax
//! agreement), all in one run so the figures compare.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use sluice_backend::{Backend, KvFormat};
use sluice_engine::{Engine, LogitsMode};

#[derive(Args)]
#[command(after_help = "Examples:\n  \
    sluice perplexity -f models/demo/eval/heldout_text.jsonl\n  \
    sluice perplexity -f text.txt --compare f16,q8,q4 --window 4096 --windows 8\n\n\
The text is a plain file, or JSON lines whose \"text\" fields are joined. It is cut into \
windows of --window tokens; each window starts a fresh request, and every token of it after \
the first is scored. With --compare, each format runs the same windows with the weights and \
kernels of the first run; KL is KL(first || compared) per position, in nats.")]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: crate::ModelArgs,
    /// The text to score.
    #[arg(
        long,
        short = 'f',
        value_name = "FILE",
        required_unless_present = "random"
    )]
    file: Option<PathBuf>,
    /// Score random token ids (seeded) instead of a text: for models with no real vocabulary
    /// (test fixtures), where only the comparison of formats means something.
    #[arg(long, conflicts_with = "file")]
    random: bool,
    /// Tokens per window [default: the model's context, at most 4096].
    #[arg(long, value_name = "TOKENS")]
    window: Option<usize>,
    /// Score at most this many windows [default: all the text holds].
    #[arg(long, value_name = "N")]
    windows: Option<usize>,
    /// KV cache formats to compare with --kv-cache's (comma-separated: f32, f16, bf16, q8, q4).
    #[arg(long, value_delimiter = ',', value_name = "FORMATS")]
    compare: Vec<KvFormat>,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    with_engine!(&a.model, |engine| run_on(engine, &a))
}

/// One format's running totals.
#[derive(Default)]
struct Score {
    nll: f64,
    kl: f64,
    agree: usize,
    count: usize,
}

fn run_on<B: Backend + 'static>(mut engine: Engine<B>, a: &PerplexityArgs) -> Result<()> {
    let info = engine.model.info().clone();
    let window = a.window.unwrap_or(info.max_context.min(4096));
    let (tokens, source) = match &a.file {
        Some(file) => {
            let text = read_text(file)?;
            (
                engine.tokenizer.encode(&text, false)?,
                file.display().to_string(),
            )
        }
        None => {
            let range = engine.tokenizer.vocab_size().min(info.vocab_size) as u64;
            let mut next = sluice_bench::model::random_tokens(range, 0x9e37_79b9_7f4a_7c15);
            let ids = (0..window * a.windows.unwrap_or(4))
                .map(|_| next())
                .collect();
            (ids, "random ids".to_string())
        }
    };
    if window < 2 {
        bail!("--window must be at least 2 tokens");
    }
    if window > info.max_context {
        bail!(
            "--window {window} is past the model's context of {} tokens",
            info.max_context
        );
    }
    let available = tokens.len() / window;
    if available == 0 {
        bail!(
            "{source} holds {} tokens, less than one window of {window}: pass a smaller --window",
            tokens.len()
        );
    }
    let n = a.windows.map_or(available, |w| w.min(available));
    let mut formats = vec![info.kv_format];
    formats.extend(a.compare.iter().copied());
    eprintln!(
        "sluice: {} tokens of {source}; {n} window{} of {window} tokens; KV cache {}",
        tokens.len(),
        if n == 1 { "" } else { "s" },
        formats
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(", then ")
    );
    let vocab = info.vocab_size;
    let mut scores: Vec<Score> = formats.iter().map(|_| Score::default()).collect();
    for (w, chunk) in tokens.chunks_exact(window).take(n).enumerate() {
        let mut base: Vec<f32> = Vec::new();
        for (i, (&format, score)) in formats.iter().zip(&mut scores).enumerate() {
            engine.model.set_kv_format(format)?;
            let mut logits = engine.logits(chunk, LogitsMode::Prefill)?;
            // Row p predicts token p + 1; the last row predicts nothing here.
            for (p, row) in logits.chunks_exact_mut(vocab).take(window - 1).enumerate() {
                log_softmax(row);
                score.nll -= row[chunk[p + 1] as usize] as f64;
                score.count += 1;
                if i > 0 {
                    let b = &base[p * vocab..(p + 1) * vocab];
                    score.kl += b
                        .iter()
                        .zip(row.iter())
                        .map(|(&lb, &lq)| (lb.exp() * (lb - lq)) as f64)
                        .sum::<f64>()
                        .max(0.0);
                    score.agree += (argmax(b) == argmax(row)) as usize;
                }
            }
            if i == 0 {
                base = logits;
            }
        }
        let s = &scores[0];
        eprintln!(
            "  window {}/{n}: perplexity so far {:.4}",
            w + 1,
            (s.nll / s.count as f64).exp()
        );
    }
    println!(
        "| KV cache | perplexity | mean KL vs {} | argmax agreement | scored tokens |",
        formats[0]
    );
    println!("|---|---|---|---|---|");
    for (format, s) in formats.iter().zip(&scores) {
        let ppl = (s.nll / s.count as f64).exp();
        if *format == formats[0] && s.kl == 0.0 && s.agree == 0 {
            println!("| {format} | {ppl:.4} | - | - | {} |", s.count);
        } else {
            println!(
                "| {format} | {ppl:.4} | {:.3e} | {:.2}% | {} |",
                s.kl / s.count as f64,
                s.agree as f64 / s.count as f64 * 100.0,
                s.count
            );
        }
    }
    Ok(())
}

/// The text of `path`: JSON lines' `text` fields joined by blank lines, else the file as it is.
fn read_text(path: &std::path::Path) -> Result<String> {
    let raw =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let is_jsonl = path.extension().is_some_and(|e| e == "jsonl");
    if !is_jsonl {
        return Ok(raw);
    }
    let mut parts = Vec::new();
    for (i, line) in raw
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) => parts.push(t.to_string()),
            None => bail!(
                "{}:{}: no \"text\" string (JSON lines need one per line)",
                path.display(),
                i + 1
            ),
        }
    }
    Ok(parts.join("\n\n"))
}

fn log_softmax(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let log_sum = max + sum.ln() as f32;
    row.iter_mut().for_each(|v| *v -= log_sum);
}

fn argmax(row: &[f32]) -> usize {
    sluice_backend::reference::argmax(row) as usize
}
