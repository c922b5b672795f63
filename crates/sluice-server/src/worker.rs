//! The model thread: one generation at a time, in arrival order, with the prompt cache.
//!
//! The engine computes on its own thread pool and blocks while it does, so it lives on a plain
//! thread fed by a channel; handlers stay async and only wait on their reply channel. Each job
//! carries a cancel flag: a handler whose client went away drops its reply channel and sets the
//! flag (see [`CancelOnDrop`]), and the generation stops at the next prompt chunk or token.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{mpsc, Arc};

use sluice_backend::Backend;
use sluice_engine::output::{OutputEvent, OutputOptions};
use sluice_engine::prompt_cache::PromptCache;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::turn::TurnEvent;
use sluice_engine::{Engine, FinishReason, GenerateRequest, GenerationStats};
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
}

/// What the model thread reports back, in order: any number of `Output`, then `Done` or `Error`.
pub enum Event {
    Output(Vec<OutputEvent>),
    /// The generation ended with `stats.finish` [`FinishReason::Stop`],
    /// [`FinishReason::StopSequence`] or [`FinishReason::Length`] (a cancelled one has no client
    /// left to tell).
    Done(GenerationStats),
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

/// Starts the model thread.
pub fn start<B: Backend + 'static>(
    engine: Arc<Engine<B>>,
    metrics: Arc<Metrics>,
    prompt_cache: usize,
) -> std::io::Result<Queue> {
    let (jobs, rx) = mpsc::channel::<Job>();
    let m = metrics.clone();
    std::thread::Builder::new()
        .name("sluice-model".into())
        .spawn(move || {
            let mut cache = PromptCache::new(prompt_cache);
            while let Ok(job) = rx.recv() {
                m.queue_depth.fetch_sub(1, Relaxed);
                m.running.store(1, Relaxed);
                run_job(&engine, &mut cache, &m, job);
                m.running.store(0, Relaxed);
            }
        })?;
    Ok(Queue { jobs, metrics })
}

fn run_job<B: Backend + 'static>(
    engine: &Engine<B>,
    cache: &mut PromptCache<B>,
    metrics: &Metrics,
    job: Job,
) {
    // Its client left while it waited.
    if job.cancel.load(Relaxed) || job.events.is_closed() {
        metrics.requests_cancelled.fetch_add(1, Relaxed);
        return;
    }
    let request = GenerateRequest {
        prompt: &job.prompt,
        params: &job.params,
        max_tokens: job.max_tokens,
        cancel: Some(&job.cancel),
        ignore_eos: job.ignore_eos,
        checkpoint: job.checkpoint,
    };
    let result = engine.chat_turn(Some(cache), &request, job.output, |event| {
        if let TurnEvent::Token { .. } = event {
            metrics.generated_tokens.fetch_add(1, Relaxed);
        }
        let output = event.into_output();
        if !output.is_empty() && job.events.send(Event::Output(output)).is_err() {
            return ControlFlow::Break(());
        }
        if job.events.is_closed() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    });
    match result {
        Ok(stats) if stats.finish == FinishReason::Cancelled => {
            metrics.requests_cancelled.fetch_add(1, Relaxed);
            metrics.record(&stats);
        }
        Ok(stats) => {
            metrics.record(&stats);
            metrics.requests_finished.fetch_add(1, Relaxed);
            let _ = job.events.send(Event::Done(stats));
        }
        Err(e) => {
            metrics.requests_failed.fetch_add(1, Relaxed);
            let _ = job.events.send(Event::Error(e.to_string()));
        }
    }
}
