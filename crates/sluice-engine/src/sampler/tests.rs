//! Sampling: parameter checks, the RNG, and each step of the pipeline against its definition.

use super::*;

fn params(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn ln(p: &[f64]) -> Vec<f32> {
    p.iter().map(|&x| x.ln() as f32).collect()
}

/// A deterministic pseudo-random logit vector of size `n`.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_f64() * 20.0 - 10.0) as f32)
        .collect()
}

#[test]
fn greedy_picks_argmax_lowest_index_on_ties() {
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[]), 1);
    assert_eq!(s.sample(&mut [1.0, 5.0, 5.0, 2.0], &[]), 1);
    assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN, 0.5], &[]), 1);
    assert_eq!(s.sample(&mut [f32::NAN, f32::NAN], &[]), 0);
    assert_eq!(s.sample(&mut [], &[]), 0);
    let big = noise(250_000, 7);
    let want = argmax(&big);
    assert_eq!(s.sample(&mut big.clone(), &[]), want);
}

#[test]
fn seed_reproduces_exactly() {
    let base = noise(50_000, 3);
    let p = SamplingParams {
        temperature: 1.3,
        top_k: 200,
        top_p: 0.9,
        seed: Some(42),
        ..SamplingParams::default()
    };
    let run = |p: &SamplingParams| {
        let mut s = Sampler::new(p.clone());
        let mut hist = Vec::new();
        for step in 0..64 {
            let mut l = base.clone();
            l[step * 7 % base.len()] += 3.0;
            hist.push(s.sample(&mut l, &hist));
        }
        hist
    };
    let a = run(&p);
    assert_eq!(a, run(&p));
    let other = run(&SamplingParams {
        seed: Some(43),
        ..p.clone()
    });
    assert_ne!(a, other, "a different seed should give a different run");
}

#[test]
fn top_k_one_is_greedy() {
    for seed in 0..20 {
        let l = noise(10_000, seed);
        let want = argmax(&l);
        let mut s = Sampler::new(SamplingParams {
            top_k: 1,
            ..params(1.5, seed)
        });
        assert_eq!(s.sample(&mut l.clone(), &[]), want);
    }
}

#[test]
fn tiny_top_p_is_greedy() {
    for seed in 0..20 {
        let l = noise(10_000, seed + 100);
        let want = argmax(&l);
        let mut s = Sampler::new(SamplingParams {
            top_p: 1e-6,
            ..params(1.0, seed)
        });
        assert_eq!(s.sample(&mut l.clone(), &[]), want);
    }
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}; 0.85 keeps {0, 1, 2}.
    let l = ln(&[0.15, 0.5, 0.05, 0.3]);
    for (top_p, allowed) in [(0.75f32, vec![1u32, 3]), (0.85, vec![1, 3, 0])] {
        let mut s = Sampler::new(SamplingParams {
            top_p,
            ..params(1.0, 9)
        });
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            seen.insert(s.sample(&mut l.clone(), &[]));
        }
        let mut seen: Vec<_> = seen.into_iter().collect();
        seen.sort();
        let mut allowed = allowed;
        allowed.sort();
        assert_eq!(seen, allowed, "top_p {top_p}");
    }
    // Over a large flat-ish vocabulary the nucleus search agrees with a full sort.
    let mut cands: Vec<Cand> = noise(100_000, 5)
        .iter()
        .enumerate()
        .map(|(i, &l)| Cand {
            rel: l - 10.0,
            weight: (l - 10.0).exp(),
            id: i as u32,
        })
        .collect();
    let total: f64 = cands.iter().map(|c| c.weight as f64).sum();
    let mut sorted = cands.clone();
    sorted.sort_by(by_rank);
    for frac in [0.1, 0.5, 0.9, 0.999] {
        let target = frac * total;
        let mut acc = 0.0;
        let want = sorted
            .iter()
            .position(|c| {
                acc += c.weight as f64;
                acc >= target
            })
            .unwrap()
            + 1;
        let got = nucleus(&mut cands, target);
        assert_eq!(got, want, "frac {frac}");
        let mut kept: Vec<u32> = cands[..got].iter().map(|c| c.id).collect();
        kept.sort();
        let mut want_ids: Vec<u32> = sorted[..want].iter().map(|c| c.id).collect();
        want_ids.sort();
        assert_eq!(kept, want_ids);
    }
}

#[test]
fn min_p_filters_unlikely_tokens() {
    // Probabilities 0.5, 0.3, 0.15, 0.05 at ids 1, 3, 0, 2. min_p 0.5 keeps p >= 0.25: {1, 3}.
    let l = ln(&[0.15, 0.5, 0.05, 0.3]);
    let mut s = Sampler::new(SamplingParams {
        min_p: 0.5,
        ..params(1.0, 11)
    });
    let mut counts = [0usize; 4];
    for _ in 0..5000 {
        counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
    }
    assert_eq!(counts[0] + counts[2], 0, "{counts:?}");
    // Renormalised 0.5 : 0.3 => 0.625 : 0.375.
    let frac = counts[1] as f64 / 5000.0;
    assert!((frac - 0.625).abs() < 0.03, "{counts:?}");
    // min_p 0.2 keeps p >= 0.1: {1, 3, 0}.
    let mut s = Sampler::new(SamplingParams {
        min_p: 0.2,
        ..params(1.0, 12)
    });
    let mut counts = [0usize; 4];
    for _ in 0..5000 {
        counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
    }
    assert_eq!(counts[2], 0);
    assert!(
        counts[0] > 0 && counts[1] > 0 && counts[3] > 0,
        "{counts:?}"
    );
}

#[test]
fn repetition_penalty_changes_the_choice() {
    // Token 2 leads but was just said; token 1 is close behind. A penalty of 1.5 turns
    // 3.0 into 2.0, below 2.5.
    let logits = [0.0f32, 2.5, 3.0, -1.0];
    let hist = [2u32, 3];
    let mut plain = Sampler::new(SamplingParams::default());
    assert_eq!(plain.sample(&mut logits.clone(), &hist), 2);
    let mut pen = Sampler::new(SamplingParams {
        repetition_penalty: 1.5,
        ..SamplingParams::default()
    });
    let mut l = logits;
    assert_eq!(pen.sample(&mut l, &hist), 1);
    // HF semantics: positive divided, negative multiplied, unseen untouched.
    assert_eq!(l, [0.0, 2.5, 2.0, -1.5]);
    // Outside the window the penalty does not apply.
    let mut windowed = Sampler::new(SamplingParams {
        repetition_penalty: 1.5,
        penalty_window: 1,
        ..SamplingParams::default()
    });
    assert_eq!(windowed.sample(&mut logits.clone(), &hist), 2);
    // Out-of-vocabulary history ids are ignored.
    assert_eq!(pen.sample(&mut logits.clone(), &[99, 1_000_000]), 2);
}

#[test]
fn presence_and_frequency_penalties() {
    let mut s = Sampler::new(SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    });
    let mut l = [1.0f32, 1.0, 1.0];
    s.sample(&mut l, &[0, 0, 0, 2]);
    assert_eq!(l, [1.0 - 0.5 - 0.75, 1.0, 1.0 - 0.5 - 0.25]);
}

#[test]
fn temperature_one_matches_probabilities() {
    let probs = [0.1, 0.2, 0.3, 0.4];
    let l = ln(&probs);
    let mut s = Sampler::new(params(1.0, 1234));
    let n = 20_000;
    let mut counts = [0usize; 4];
    for _ in 0..n {
        counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
    }
    for (i, &p) in probs.iter().enumerate() {
        let f = counts[i] as f64 / n as f64;
        // 4 standard deviations of a binomial proportion.
        let tol = 4.0 * (p * (1.0 - p) / n as f64).sqrt();
        assert!((f - p).abs() < tol, "token {i}: {f} vs {p} ({counts:?})");
    }
    // With top-k 3 the lowest drops out and the rest renormalise over 0.9.
    let mut s = Sampler::new(SamplingParams {
        top_k: 3,
        ..params(1.0, 99)
    });
    let mut counts = [0usize; 4];
    for _ in 0..n {
        counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
    }
    assert_eq!(counts[0], 0);
    let f = counts[3] as f64 / n as f64;
    assert!((f - 0.4 / 0.9).abs() < 0.02, "{counts:?}");
}

#[test]
fn fast_exp_is_accurate() {
    assert_eq!(fast_exp(0.0), 1.0);
    assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(fast_exp(-88.0), 0.0);
    let mut prev = 0.0;
    let mut x = -87.0f32;
    while x <= 0.0 {
        let (got, want) = (fast_exp(x), (x as f64).exp());
        assert!(
            ((got as f64 - want) / want).abs() < 1e-6,
            "exp({x}) = {got} vs {want}"
        );
        assert!(got >= prev, "not monotone at {x}");
        prev = got;
        x += 0.0123;
    }
}

#[test]
fn top_k_heap_matches_a_sort() {
    for (seed, k) in [(1u64, 1usize), (2, 5), (3, 40), (4, 1000), (5, 5000)] {
        // Coarse values so there are many ties; some zero weights.
        let rel: Vec<f32> = noise(20_000, seed)
            .iter()
            .map(|x| (x * 2.0).round() - 40.0)
            .collect();
        let weights: Vec<f32> = rel
            .iter()
            .map(|&r| if r < -55.0 { 0.0 } else { fast_exp(r) })
            .collect();
        let mut got = Vec::new();
        top_k_into(&rel, &weights, k, &mut got);
        let mut got: Vec<u32> = got.iter().map(|c| c.id).collect();
        got.sort();
        let mut all: Vec<Cand> = (0..rel.len())
            .filter(|&i| weights[i] > 0.0)
            .map(|i| Cand {
                rel: rel[i],
                weight: weights[i],
                id: i as u32,
            })
            .collect();
        all.sort_by(by_rank);
        let mut want: Vec<u32> = all.iter().take(k).map(|c| c.id).collect();
        want.sort();
        assert_eq!(got, want, "k {k}");
    }
}

#[test]
fn banned_tokens_are_never_drawn() {
    let l = [0.0f32, f32::NEG_INFINITY, 0.0, f32::NAN, -80.0];
    for p in [
        params(1.0, 3),
        SamplingParams {
            top_p: 0.999,
            ..params(1.0, 4)
        },
        SamplingParams {
            top_k: 4,
            ..params(2.0, 5)
        },
        SamplingParams {
            min_p: 1e-30,
            ..params(50.0, 6)
        },
    ] {
        let mut s = Sampler::new(p);
        for _ in 0..2000 {
            let t = s.sample(&mut l.clone(), &[]);
            assert!(t != 1 && t != 3, "drew banned token {t}");
        }
    }
}

#[test]
fn non_finite_logits_do_not_panic() {
    let cases: Vec<Vec<f32>> = vec![
        vec![f32::NAN, 1.0, f32::NEG_INFINITY, 0.5],
        vec![f32::NAN; 5],
        vec![f32::NEG_INFINITY; 5],
        vec![1.0, f32::INFINITY, 2.0, f32::INFINITY],
        vec![f32::MAX, -f32::MAX, 0.0],
    ];
    for p in [
        params(1.0, 1),
        SamplingParams {
            top_k: 2,
            top_p: 0.5,
            min_p: 0.1,
            repetition_penalty: 1.3,
            ..params(0.7, 2)
        },
        SamplingParams {
            top_p: 0.9,
            ..params(1e-30, 3)
        },
    ] {
        let mut s = Sampler::new(p);
        for c in &cases {
            let t = s.sample(&mut c.clone(), &[1, 2]);
            assert!((t as usize) < c.len());
        }
    }
    let mut s = Sampler::new(params(1.0, 5));
    for _ in 0..50 {
        let t = s.sample(&mut [1.0, f32::INFINITY, 2.0, f32::INFINITY], &[]);
        assert!(t == 1 || t == 3);
        assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN], &[]), 1);
    }
}

#[test]
fn out_of_range_params_do_not_panic() {
    let l = noise(1000, 1);
    for p in [
        SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            top_p: 7.0,
            min_p: 3.0,
            repetition_penalty: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: usize::MAX,
            top_p: -1.0,
            min_p: f32::NAN,
            repetition_penalty: f32::INFINITY,
            presence_penalty: f32::NAN,
            penalty_window: usize::MAX,
            seed: Some(0),
            ..SamplingParams::default()
        },
    ] {
        let mut s = Sampler::new(p);
        assert!((s.sample(&mut l.clone(), &[1, 2, 3]) as usize) < l.len());
    }
}

#[test]
fn validate_reports_bad_values() {
    assert!(SamplingParams::default().validate().is_ok());
    let ok = SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.1,
        presence_penalty: -1.5,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    assert!(ok.validate().is_ok());
    let bad = |f: fn(&mut SamplingParams), word: &str| {
        let mut p = ok.clone();
        f(&mut p);
        let e = p.validate().expect_err(word);
        assert!(e.contains(word), "{e}");
    };
    bad(|p| p.temperature = -0.1, "temperature");
    bad(|p| p.temperature = f32::NAN, "temperature");
    bad(|p| p.temperature = f32::INFINITY, "temperature");
    bad(|p| p.top_p = 0.0, "top_p");
    bad(|p| p.top_p = 1.01, "top_p");
    bad(|p| p.top_p = f32::NAN, "top_p");
    bad(|p| p.min_p = 1.0, "min_p");
    bad(|p| p.min_p = -0.1, "min_p");
    bad(|p| p.min_p = f32::NAN, "min_p");
    bad(|p| p.repetition_penalty = 0.0, "repetition_penalty");
    bad(|p| p.repetition_penalty = -1.0, "repetition_penalty");
    bad(|p| p.repetition_penalty = f32::NAN, "repetition_penalty");
    bad(|p| p.presence_penalty = f32::NAN, "presence_penalty");
    bad(|p| p.frequency_penalty = f32::INFINITY, "frequency_penalty");
}

/// Times the expensive paths at a 250k vocabulary. The bound is loose so a loaded machine
/// does not fail it; the printed numbers are the measurement.
#[test]
fn fast_at_250k_vocab() {
    let base = noise(250_000, 77);
    let flat = vec![0.0f32; 250_000];
    let cases = [
        (
            "top_p 0.95",
            base.clone(),
            SamplingParams {
                top_p: 0.95,
                ..params(1.0, 1)
            },
        ),
        (
            "top_k 40 + top_p",
            base.clone(),
            SamplingParams {
                top_k: 40,
                top_p: 0.9,
                ..params(0.8, 1)
            },
        ),
        (
            "min_p 0.05",
            base.clone(),
            SamplingParams {
                min_p: 0.05,
                ..params(1.0, 1)
            },
        ),
        ("plain", base.clone(), params(1.0, 1)),
        (
            "top_p flat (worst case)",
            flat,
            SamplingParams {
                top_p: 0.9,
                ..params(1.0, 1)
            },
        ),
    ];
    for (name, logits, p) in cases {
        let mut s = Sampler::new(p);
        let reps = 20;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            let mut l = logits.clone();
            std::hint::black_box(s.sample(&mut l, &[1, 2, 3]));
        }
        let per = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
        eprintln!("sample {name}: {per:.2} ms (incl. a 1 MB clone)");
        assert!(per < 100.0, "{name}: {per} ms");
        // The same draw from the part of the row a backend would send (here cut on the host).
        let mut s = Sampler::new(s.params().clone());
        let start = std::time::Instant::now();
        for _ in 0..reps {
            if let Some(req) = s.top_request(logits.len(), &[1, 2, 3]) {
                let part = sluice_backend::reference::top_logits(&logits, req.n, &req.cols);
                std::hint::black_box(s.sample_top(&req, &part, &[1, 2, 3]));
            }
        }
        let per = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
        eprintln!("sample_top {name}: {per:.2} ms (incl. the host's top_logits)");
        assert!(per < 100.0, "{name}: {per} ms");
    }
}

/// Sampling from the part of a row `top_request` asks for draws the same tokens, with the same
/// random numbers, as sampling from the whole row: greedy and top-k, with top-p, min-p and
/// penalties, over random rows (with ties planted) of a small and a real vocabulary.
#[test]
fn sample_top_matches_sample() {
    let mut decided = 0;
    let mut steps = 0;
    for (vocab, temps) in [(1000, vec![0.0, 0.3, 1.0]), (151_936, vec![0.0, 0.7])] {
        for temperature in temps {
            for (top_k, top_p, min_p) in [
                (1, 1.0, 0.0),
                (20, 0.8, 0.0),
                (64, 1.0, 0.05),
                (256, 0.95, 0.0),
            ] {
                for (penalties, biased) in [(false, false), (true, false), (true, true)] {
                    // Biases that lift a token into (and push the leader out of) the top, and
                    // one past the vocabulary.
                    let logit_bias = match biased {
                        true => vec![(5, 30.0), (10, -100.0), (42, 8.0), (vocab as u32 - 1, 2.5)]
                            .into_iter()
                            .chain([(vocab as u32 + 10, 50.0)])
                            .collect(),
                        false => vec![],
                    };
                    let p = SamplingParams {
                        logit_bias,
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repetition_penalty: if penalties { 1.3 } else { 1.0 },
                        presence_penalty: if penalties { 0.4 } else { 0.0 },
                        frequency_penalty: if penalties { -0.2 } else { 0.0 },
                        seed: Some(vocab as u64 + top_k as u64),
                        ..SamplingParams::default()
                    };
                    let (mut whole, mut part) = (Sampler::new(p.clone()), Sampler::new(p));
                    let mut history: Vec<u32> = vec![3, 3, 17, 250, 999];
                    for step in 0..6 {
                        let mut logits = noise(vocab, 7 * step + top_k as u64);
                        // Ties at the top and near the k-th place; a history token at the top.
                        logits[10] = 12.0;
                        logits[900] = 12.0;
                        logits[17] = 11.5;
                        logits[40] = logits[41];
                        let want = whole.sample(&mut logits.clone(), &history);
                        let got = match part.top_request(vocab, &history) {
                            Some(req) => {
                                let top = sluice_backend::reference::top_logits(
                                    &logits, req.n, &req.cols,
                                );
                                part.sample_top(&req, &top, &history)
                            }
                            None => None,
                        };
                        steps += 1;
                        let got = match got {
                            Some(t) => {
                                decided += 1;
                                t
                            }
                            None => part.sample(&mut logits.clone(), &history),
                        };
                        assert_eq!(got, want, "vocab {vocab}, t {temperature}, top_k {top_k}, top_p {top_p}, min_p {min_p}, penalties {penalties}, biased {biased}, step {step}");
                        history.push(want);
                    }
                }
            }
        }
    }
    // The part decided nearly every step (falling back to the whole row is allowed, but rare).
    assert!(decided * 10 >= steps * 9, "decided {decided} of {steps}");
}

/// OpenAI's `logit_bias`: +100 forces a token, -100 bans the leader, in every sampling mode;
/// the biased columns are asked of the device.
#[test]
fn logit_bias_forces_and_bans() {
    let logits = noise(1000, 3);
    for temperature in [0.0, 1.0] {
        for top_k in [0, 20] {
            let p = SamplingParams {
                temperature,
                top_k,
                seed: Some(7),
                logit_bias: vec![(123, 100.0)],
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(p.clone());
            assert!(!s.is_argmax());
            for _ in 0..20 {
                assert_eq!(s.sample(&mut logits.clone(), &[]), 123);
            }
            if let Some(req) = s.top_request(1000, &[]) {
                assert!(req.cols.contains(&123));
                let top = sluice_backend::reference::top_logits(&logits, req.n, &req.cols);
                assert_eq!(s.sample_top(&req, &top, &[]), Some(123));
            }
        }
    }
    let best = argmax(&logits);
    let mut s = Sampler::new(SamplingParams {
        logit_bias: vec![(best, -100.0)],
        ..SamplingParams::default()
    });
    assert_ne!(s.sample(&mut logits.clone(), &[]), best);
    let bad = |bias: Vec<(u32, f32)>| {
        SamplingParams {
            logit_bias: bias,
            ..SamplingParams::default()
        }
        .validate()
        .unwrap_err()
    };
    assert!(bad(vec![(1, 100.5)]).contains("logit_bias"));
    assert!(bad(vec![(1, f32::NAN)]).contains("logit_bias"));
    assert!(bad(vec![(2, 1.0), (1, 1.0)]).contains("ascending"));
}

#[test]
fn top_request_covers_the_penalised_tokens() {
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        repetition_penalty: 1.1,
        seed: Some(1),
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(p);
    let req = s.top_request(1000, &[5, 7, 5, 2000]).unwrap();
    assert_eq!(
        (req.n, req.cols),
        (23, vec![5, 7]),
        "out-of-vocabulary history ignored"
    );
    let mut big = Sampler::new(SamplingParams {
        temperature: 0.8,
        top_k: 0,
        ..SamplingParams::default()
    });
    assert_eq!(big.top_request(1000, &[]), None, "no top-k: the whole row");
}

#[test]
fn sample_top_greedy_tie_after_penalties_goes_to_the_lower_id() {
    // Token 9 ranks first before the penalties; token 4, raised from 2.0 to 3.0 by a negative
    // presence penalty, ties with it afterwards and wins by its lower id, as on the whole row.
    let mut logits = vec![0.0f32; 50];
    logits[9] = 3.0;
    logits[4] = 2.0;
    let p = SamplingParams {
        presence_penalty: -1.0,
        ..SamplingParams::default()
    };
    let history = [4];
    let want = Sampler::new(p.clone()).sample(&mut logits.clone(), &history);
    let mut s = Sampler::new(p);
    let req = s.top_request(logits.len(), &history).unwrap();
    let part = sluice_backend::reference::top_logits(&logits, req.n, &req.cols);
    assert_eq!(want, 4);
    assert_eq!(s.sample_top(&req, &part, &history), Some(want));
}
