// Drives sluice serve's web page in headless Chromium against a running server (run.sh starts
// one on the demo model with an API key): the key dialog, a streamed answer, stopping a long
// answer (and the server cancelling it), a tool call answered by the page, and the expert view
// changing while a generation runs. With --screenshots DIR it saves the README's pictures.
//
// node test.mjs --base http://127.0.0.1:PORT --api-key KEY [--chromium PATH] [--screenshots DIR]
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { parseArgs } from 'node:util';

const { values: opts } = parseArgs({
  options: {
    base: { type: 'string' },
    'api-key': { type: 'string' },
    chromium: { type: 'string', default: '/usr/bin/chromium' },
    screenshots: { type: 'string' },
  },
});
if (!opts.base || !opts['api-key']) {
  console.error('usage: node test.mjs --base URL --api-key KEY [--chromium PATH] [--screenshots DIR]');
  process.exit(2);
}
const base = opts.base.replace(/\/$/, '');

let failures = 0;
function check(ok, what) {
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}`);
  if (!ok) failures += 1;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function stats() {
  const r = await fetch(`${base}/stats`);
  if (!r.ok) throw new Error(`/stats answered ${r.status}`);
  return r.json();
}

/** Polls `f` until it returns something truthy, or fails after `ms`. */
async function until(what, f, ms = 10000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

const browser = await chromium.launch({
  executablePath: opts.chromium,
  // Without the background-networking flags Chromium can hang on connections it cannot make.
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  timeout: 60000,
});
const page = await browser.newPage({ viewport: { width: 1440, height: 900 } });
page.setDefaultTimeout(30000);
const problems = [];
page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
page.on('console', (m) => {
  // The first /v1/models is refused until the key is given: expected.
  if (m.type() === 'error' && !/status of 401/.test(m.text())) problems.push(`console error: ${m.text()}`);
});
page.on('requestfailed', (r) => {
  // Aborted by the stop button, or the stats stream closed with the view: expected.
  if (!/\/v1\/chat\/completions|\/stats\/stream/.test(r.url())) problems.push(`request failed: ${r.url()} ${r.failure()?.errorText}`);
});
const shots = opts.screenshots;
if (shots) mkdirSync(shots, { recursive: true });

async function setSettings({ temperature = '', maxTokens = '', extra = '' }) {
  await page.click('#open-settings');
  await page.fill('#set-temperature', String(temperature));
  await page.fill('#set-max-tokens', String(maxTokens));
  await page.fill('#set-extra', extra);
  await page.click('#save-settings');
  await page.waitForSelector('#settings', { state: 'hidden' });
}

async function send(text) {
  await page.fill('#input', text);
  await page.press('#input', 'Enter');
}

const lastAnswer = () => page.locator('.msg.assistant').last();

async function run() {
  // 1. The page loads, asks for the key (the server has one) and shows the model.
  const response = await page.goto(`${base}/`);
  check(response.ok() && response.headers()['content-type'].startsWith('text/html'), 'GET / is the page');
  await page.waitForSelector('#key-dialog[open]');
  await page.fill('#key-input', opts['api-key']);
  await page.click('#key-form button[value=ok]');
  await page.waitForFunction(() => /tokens of context/.test(document.querySelector('#model-name').textContent));
  check(true, `the key is asked for and accepted: ${await page.textContent('#model-name')}`);

  // 2. A streamed answer: the message grows in several steps before it is done.
  await page.evaluate(() => {
    window.seenLengths = [];
    new MutationObserver(() => {
      const m = [...document.querySelectorAll('.msg.assistant')].pop();
      if (m?.dataset.state !== 'streaming') return;
      const n = m.querySelector('.body')?.textContent.length || 0;
      if (n && window.seenLengths.at(-1) !== n) window.seenLengths.push(n);
    }).observe(document.querySelector('#messages'), { childList: true, subtree: true });
  });
  await send('Tell me a story about a fox.');
  await page.waitForSelector('.msg.assistant[data-state=done]');
  const story = await lastAnswer().locator('.body').textContent();
  const steps = await page.evaluate(() => window.seenLengths.length);
  check(story.length > 40, `an answer came: "${story.slice(0, 60)}..." (${story.length} characters)`);
  check(steps >= 2, `it streamed: shown in ${steps} partial steps before the end`);
  check(/tok\/s/.test(await lastAnswer().locator('.meta').textContent()), 'its speed is shown');

  // 2b. Rendering, from a canned stream (the demo model writes no Markdown, code or reasoning):
  // Markdown, highlighted code, folded reasoning; the model's raw HTML and javascript: links
  // stay inert.
  const chunk = (delta, finish = null) => `data: ${JSON.stringify({ choices: [{ index: 0, delta, finish_reason: finish }] })}\n\n`;
  const canned = [
    chunk({ role: 'assistant', content: '' }),
    chunk({ reasoning_content: 'The user wants Rust. ' }),
    chunk({ reasoning_content: 'Keep it short.' }),
    chunk({ content: '## Hello\n\nA **bold** word, <img src=x id=injected onerror="window.pwned=1">' }),
    chunk({ content: ' and [a link](javascript:window.pwned=1).\n\n```rust\nfn main() { let x = 1; }\n```\n' }),
    chunk({}, 'stop'),
    'data: [DONE]\n\n',
  ].join('');
  await page.route('**/v1/chat/completions', (route) => route.fulfill({
    status: 200, headers: { 'content-type': 'text/event-stream' }, body: canned,
  }));
  await page.click('#new-chat');
  await send('Show me some Rust.');
  await page.waitForSelector('.msg.assistant[data-state=done]');
  const rendered = await page.evaluate(() => {
    const m = [...document.querySelectorAll('.msg.assistant')].pop();
    const details = m.querySelector('details.reasoning');
    return {
      heading: m.querySelector('.body h2')?.textContent,
      bold: m.querySelector('.body strong')?.textContent,
      keyword: m.querySelector('.body pre code.language-rust .hljs-keyword')?.textContent,
      reasoning: details && !details.open && details.textContent.includes('Keep it short.'),
      injected: !!document.querySelector('#injected') || !!window.pwned,
      links: m.querySelectorAll('.body a').length,
      text: m.querySelector('.body').textContent,
    };
  });
  await page.unroute('**/v1/chat/completions');
  check(rendered.heading === 'Hello' && rendered.bold === 'bold', 'Markdown is rendered');
  check(rendered.keyword === 'fn', 'code is highlighted');
  check(rendered.reasoning, 'reasoning is shown folded');
  check(!rendered.injected && rendered.links === 0 && rendered.text.includes('<img'),
    'the model\'s HTML is shown as text and its javascript: link is not a link');

  // 3. Stop a long answer: the page says stopped and the server cancels the generation.
  const before = await stats();
  await setSettings({ maxTokens: 3000, extra: '{"ignore_eos": true}' });
  await page.click('#new-chat');
  await send('Tell me a long story.');
  await page.waitForFunction(() => {
    const m = [...document.querySelectorAll('.msg.assistant')].pop();
    return m?.dataset.state === 'streaming' && m.querySelector('.body').textContent.length > 40;
  });
  await page.click('#stop');
  await page.waitForSelector('.msg.assistant[data-state=stopped] .meta .stopped');
  check(await page.isVisible('#send'), 'after Stop the answer is marked stopped and Send is back');
  const after = await until('the server to cancel the request', async () => {
    const s = await stats();
    return s.requests.cancelled > before.requests.cancelled && s.requests.running === 0 && s;
  });
  await sleep(500);
  const later = await stats();
  const generated = after.tokens.generated - before.tokens.generated;
  check(later.tokens.generated === after.tokens.generated && generated < 3000,
    `the server cancelled it (cancelled ${before.requests.cancelled} -> ${after.requests.cancelled}, ${generated} of 3000 tokens generated, none since)`);

  // 4. A tool call: get_weather, answered by the page's fake function, then the model's answer.
  await setSettings({ temperature: 0 });
  await page.click('#new-chat');
  await send('What is the weather in Paris?');
  const call = await page.waitForSelector('.toolbox.call');
  check(/get_weather\(.*Paris/.test(await call.textContent()), `a tool call is shown: ${await call.textContent()}`);
  const result = await page.waitForSelector('.toolbox.result');
  const weather = JSON.parse((await result.textContent()).replace(/^get_weather result/, ''));
  check(Number.isInteger(weather.temperature), `the page answered it: ${JSON.stringify(weather)}`);
  await page.waitForFunction(() => {
    const msgs = [...document.querySelectorAll('.msg')];
    const last = msgs.at(-1);
    return msgs.at(-2)?.classList.contains('tool') && last.dataset.state === 'done';
  });
  const answer = await lastAnswer().locator('.body').textContent();
  check(answer.includes(String(weather.temperature)), `and the model answered from it: "${answer.trim()}"`);
  // The same conversation goes on (for the picture: a streamed story after the tool round trip).
  await send('Tell me a story about a fox.');
  await page.waitForFunction(() => document.querySelectorAll('.msg.assistant[data-state=done]').length >= 3);
  if (shots) await page.screenshot({ path: `${shots}/web-chat.png` });

  // 5. The expert view: connected, and changing while a generation runs.
  await page.click('#toggle-experts');
  await page.waitForSelector('#expert-map[data-snapshots]');
  const status = await page.textContent('#ex-status');
  check(/streaming from disk/.test(status), `the expert view says how experts stream: ${status.slice(0, 100)}...`);
  await setSettings({ maxTokens: 2000, extra: '{"ignore_eos": true}' });
  await page.click('#new-chat');
  await send('Tell me a story about a brave little duck.');
  await page.waitForSelector('.msg.assistant[data-state=streaming]');
  const maps = new Set();
  let events = 0;
  let fastest = 0;
  for (let i = 0; i < 16; i += 1) {
    await sleep(250);
    const map = await page.getAttribute('#expert-map', 'data-map');
    maps.add(map);
    // Digits g-v have the fresh bit: something happened to the expert since the last snapshot.
    if (/[g-v]/.test(map)) events += 1;
    fastest = Math.max(fastest, Number(await page.textContent('#tile-toks')) || 0);
  }
  if (shots) await page.locator('#experts').screenshot({ path: `${shots}/web-experts.png` });
  check(maps.size >= 3, `the layer x expert map changed while it generated (${maps.size} different maps in 16 looks)`);
  check(events >= 3, `with hits, reads and evictions in it (${events} of 16 looks)`);
  check(fastest > 0, `tokens/s shown (${fastest})`);
  const plotted = await page.evaluate(() => document.querySelectorAll('#plot-speed canvas, #plot-cache canvas').length);
  check(plotted >= 2, 'the plots are drawn');
  await page.click('#stop');
  await page.waitForSelector('#send', { state: 'visible' });

  check(problems.length === 0, `no errors in the page${problems.length ? `:\n  ${problems.join('\n  ')}` : ''}`);
}

try {
  await run();
} catch (e) {
  console.log(`FAIL ${e.stack || e}`);
  failures += 1;
  if (shots) await page.screenshot({ path: `${shots}/failure.png` }).catch(() => {});
} finally {
  await browser.close();
}
console.log(failures ? `${failures} failed` : 'browser test: all passed');
process.exit(failures ? 1 : 0);
