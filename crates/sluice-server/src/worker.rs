//! The model thread: continuous batching over the jobs, with the prompt cache.
//!
//! Up to `parallel` generations run together: every step decodes a token for each of them in
//! one forward pass (weights and experts read once for all) and reads a chunk of the oldest
//! waiting prompt beside them; a new job joins at the next step, an ended one leaves at once, and
//! jobs beyond `parallel` wait in arrival order. The engine computes on its own thread pool and
//! blocks while it does, so it lives on a plain thread fed by a channel; handlers stay async and
//! only wait on their reply channel. Each job carries a cancel flag: a handler whose client went
//! away drops its reply channel and sets the flag (see [`CancelOnDrop`]), and the generation stops
//! at its next step.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use sluice_backend::Backend;
use sluice_engine::batch::{Sequence, Sink};
use sluice_engine::output::{OutputEvent, OutputOptions};
use sluice_engine::prompt_cache::PromptCache;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::turn::{TurnEvent, TurnSink};
use sluice_engine::{Engine, FinishReason, GenerateRequest, GenerationStats, Halt, TokenEvent};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// One generation to run.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub checkpoint: Option<usize>,
    pub output: OutputOptions,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    /// When the handler queued it (for the latency metrics).
    pub submitted: Instant,
}

/// What the model thread reports back, in order: any number of `Output`, then `Done` or `Error`.
pub enum Event {
    Output(Vec<OutputEvent>),
    /// The generation ended with `stats.finish` [`FinishReason::Stop`],
    /// [`FinishReason::StopSequence`] (`stop_sequence` says which) or [`FinishReason::Length`]
    /// (a cancelled one has no client left to tell).
    Done {
        stats: GenerationStats,
        stop_sequence: Option<String>,
    },
    Error(String),
}

/// Sets the cancel flag when dropped: handlers hold one for as long as their client listens.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Relaxed);
    }
}

/// The sending side of the queue.
#[derive(Clone)]
pub struct Queue {
    jobs: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// Queues `job`; false if the model thread has stopped.
    pub fn submit(&self, job: Job) -> bool {
        self.metrics.queue_depth.fetch_add(1, Relaxed);
        if self.jobs.send(job).is_err() {
            self.metrics.queue_depth.fetch_sub(1, Relaxed);
            return false;
        }
        true
    }
}

/// A job's output side while it runs: its parsed chat output goes to the handler's channel;
/// it is cancelled when the handler sets the flag or drops the channel.
struct JobSink {
    turn: TurnSink<'static, Box<dyn FnMut(TurnEvent) -> ControlFlow<()> + Send>>,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
}

impl Sink for JobSink {
    fn event(&mut self, event: TokenEvent<'_>) -> ControlFlow<Halt> {
        self.turn.event(event)
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Relaxed) || self.events.is_closed()
    }
}

/// Starts the model thread, which runs up to `parallel` jobs at once.
pub fn start<B: Backend + 'static>(
    engine: Arc<Engine<B>>,
    metrics: Arc<Metrics>,
    prompt_cache: usize,
    parallel: usize,
) -> std::io::Result<Queue> {
    let (jobs, rx) = mpsc::channel::<Job>();
    let m = metrics.clone();
    std::thread::Builder::new()
        .name("sluice-model".into())
        .spawn(move || schedule(&engine, &m, &rx, prompt_cache, parallel.max(1)))?;
    Ok(Queue { jobs, metrics })
}

/// Continuous batching: jobs join the running batch as they arrive (up to `parallel`; the rest
/// wait in arrival order), every step advances them all, and each leaves as soon as it ends.
fn schedule<B: Backend + 'static>(
    engine: &Engine<B>,
    metrics: &Arc<Metrics>,
    rx: &mpsc::Receiver<Job>,
    prompt_cache: usize,
    parallel: usize,
) {
    let mut cache = PromptCache::new(prompt_cache);
    let mut running: Vec<Sequence<'_, B, JobSink>> = Vec::new();
    loop {
        // Idle: wait for work. Busy: take what has arrived, without waiting.
        if running.is_empty() {
            match rx.recv() {
                Ok(job) => admit(engine, &mut cache, metrics, job, &mut running),
                Err(_) => return,
            }
        }
        while running.len() < parallel {
            match rx.try_recv() {
                Ok(job) => admit(engine, &mut cache, metrics, job, &mut running),
                Err(_) => break,
            }
        }
        if running.is_empty() {
            continue;
        }
        metrics.running.store(running.len() as u64, Relaxed);
        metrics.record_step(running.len());
        engine.step(
            &mut running.iter_mut().collect::<Vec<_>>(),
            Some(&mut cache),
        );
        for sequence in std::mem::take(&mut running) {
            if sequence.is_finished() {
                retire(&mut cache, metrics, sequence);
            } else {
                running.push(sequence);
            }
        }
        metrics.running.store(running.len() as u64, Relaxed);
    }
}

fn admit<'e, B: Backend + 'static>(
    engine: &'e Engine<B>,
    cache: &mut PromptCache<B>,
    metrics: &Arc<Metrics>,
    job: Job,
    running: &mut Vec<Sequence<'e, B, JobSink>>,
) {
    metrics.queue_depth.fetch_sub(1, Relaxed);
    // Its client left while it waited.
    if job.cancel.load(Relaxed) || job.events.is_closed() {
        metrics.requests_cancelled.fetch_add(1, Relaxed);
        return;
    }
    let request = GenerateRequest {
        prompt: &job.prompt,
        params: &job.params,
        max_tokens: job.max_tokens,
        cancel: None,
        ignore_eos: job.ignore_eos,
        checkpoint: job.checkpoint,
    };
    let (events, errors, m) = (job.events.clone(), job.events.clone(), metrics.clone());
    let on_event: Box<dyn FnMut(TurnEvent) -> ControlFlow<()> + Send> =
        Box::new(move |event: TurnEvent| {
            if let TurnEvent::Token { .. } = event {
                m.generated_tokens.fetch_add(1, Relaxed);
            }
            let output = event.into_output();
            if !output.is_empty() && events.send(Event::Output(output)).is_err() {
                return ControlFlow::Break(());
            }
            if events.is_closed() {
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        });
    let sink = JobSink {
        turn: TurnSink::new(job.output, None, on_event),
        events: job.events,
        cancel: job.cancel,
        submitted: job.submitted,
    };
    match engine.sequence(Some(cache), &request, sink) {
        Ok(sequence) => running.push(sequence),
        Err(e) => {
            metrics.requests_failed.fetch_add(1, Relaxed);
            let _ = errors.send(Event::Error(e.to_string()));
        }
    }
}

/// Reports an ended job to its handler and the metrics.
fn retire<B: Backend + 'static>(
    cache: &mut PromptCache<B>,
    metrics: &Metrics,
    sequence: Sequence<'_, B, JobSink>,
) {
    let (result, sink) = sequence.finish(Some(cache));
    let JobSink {
        turn,
        events,
        submitted,
        ..
    } = sink;
    match result {
        Ok(stats) if stats.finish == FinishReason::Cancelled => {
            metrics.requests_cancelled.fetch_add(1, Relaxed);
            metrics.record(&stats, submitted.elapsed());
        }
        Ok(stats) => {
            let stop_sequence = turn.end();
            metrics.record(&stats, submitted.elapsed());
            metrics.requests_finished.fetch_add(1, Relaxed);
            let _ = events.send(Event::Done {
                stats,
                stop_sequence,
            });
        }
        Err(e) => {
            metrics.requests_failed.fetch_add(1, Relaxed);
            let _ = events.send(Event::Error(e.to_string()));
        }
    }
}
