// Measures what watching costs generation: the same long generation (ignore_eos) timed with
// nobody watching, with a plain client reading /stats/stream (the server's own cost), and with
// the web page's expert view open in headless Chromium on the same machine (adds the browser's
// CPU). Rounds alternate so that drift hits every case alike.
//
// node overhead.mjs --base http://127.0.0.1:PORT [--tokens 1000] [--rounds 4] [--chromium PATH]
import { chromium } from 'playwright-core';
import { parseArgs } from 'node:util';

const { values: opts } = parseArgs({
  options: {
    base: { type: 'string' },
    tokens: { type: 'string', default: '1000' },
    rounds: { type: 'string', default: '4' },
    chromium: { type: 'string', default: '/usr/bin/chromium' },
    'api-key': { type: 'string', default: '' },
  },
});
const base = opts.base.replace(/\/$/, '');
const tokens = Number(opts.tokens);
const headers = { 'Content-Type': 'application/json' };
if (opts['api-key']) headers.Authorization = `Bearer ${opts['api-key']}`;

async function generate() {
  const t = performance.now();
  const r = await fetch(`${base}/v1/completions`, {
    method: 'POST', headers,
    body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: tokens, ignore_eos: true, temperature: 0 }),
  });
  const j = await r.json();
  const secs = (performance.now() - t) / 1000;
  if (j.usage.completion_tokens !== tokens) throw new Error(JSON.stringify(j.usage));
  return tokens / secs;
}

/** A client reading the stats stream until told to stop; returns the stop function. */
async function sseClient() {
  const ac = new AbortController();
  const r = await fetch(`${base}/stats/stream`, { signal: ac.signal });
  const reader = r.body.getReader();
  let events = 0;
  const done = (async () => {
    try { for (;;) { const { done, value } = await reader.read(); if (done) break; events += new TextDecoder().decode(value).split('data:').length - 1; } } catch {}
  })();
  return async () => { ac.abort(); await done; return events; };
}

const browser = await chromium.launch({
  executablePath: opts.chromium,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});

const results = { none: [], stream: [], page: [] };
await generate(); // warm-up
for (let round = 0; round < Number(opts.rounds); round += 1) {
  results.none.push(await generate());
  const stop = await sseClient();
  results.stream.push(await generate());
  const events = await stop();
  const page = await browser.newPage({ viewport: { width: 1440, height: 900 } });
  await page.goto(`${base}/`);
  await page.click('#toggle-experts');
  await page.waitForSelector('#expert-map[data-snapshots]');
  results.page.push(await generate());
  const snapshots = await page.getAttribute('#expert-map', 'data-snapshots');
  await page.close();
  console.log(`round ${round}: none ${results.none.at(-1).toFixed(1)}, stream ${results.stream.at(-1).toFixed(1)} (${events} events), page ${results.page.at(-1).toFixed(1)} tok/s (${snapshots} snapshots drawn)`);
}
await browser.close();
const median = (v) => [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)];
const m = Object.fromEntries(Object.entries(results).map(([k, v]) => [k, median(v)]));
console.log(`median tok/s over ${opts.rounds} rounds of ${tokens} tokens: nobody watching ${m.none.toFixed(1)}, /stats/stream client ${m.stream.toFixed(1)} (ratio ${(m.stream / m.none).toFixed(3)}), expert view open in Chromium on the same machine ${m.page.toFixed(1)} (ratio ${(m.page / m.none).toFixed(3)})`);
