// The chat: conversations in local storage, answers streamed from /v1/chat/completions and
// rendered as Markdown, reasoning folded, tool calls shown (the demo's get_weather answered
// here), and a stop button that ends the request (the server cancels the generation when the
// connection closes).
import { Marked } from './vendor/marked.esm.js';
import hljs from './vendor/hljs/core.min.js';
import bash from './vendor/hljs/languages/bash.min.js';
import c from './vendor/hljs/languages/c.min.js';
import cpp from './vendor/hljs/languages/cpp.min.js';
import go from './vendor/hljs/languages/go.min.js';
import javascript from './vendor/hljs/languages/javascript.min.js';
import json from './vendor/hljs/languages/json.min.js';
import python from './vendor/hljs/languages/python.min.js';
import rust from './vendor/hljs/languages/rust.min.js';
import typescript from './vendor/hljs/languages/typescript.min.js';
import xml from './vendor/hljs/languages/xml.min.js';
import { $, api, errorText, loadSettings } from './util.js';

const languages = { bash, c, cpp, go, javascript, json, python, rust, typescript, xml };
for (const [name, grammar] of Object.entries(languages)) hljs.registerLanguage(name, grammar);
hljs.registerAliases(['sh', 'shell', 'console', 'zsh'], { languageName: 'bash' });
hljs.registerAliases(['html', 'svg'], { languageName: 'xml' });

const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (ch) => ({
  '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;',
}[ch]));
const safeUrl = (href) => (/^(https?:|mailto:|#)/i.test(href || '') ? href : null);

// Model output is untrusted: raw HTML is shown as text, links only to web pages, no images
// (the page's Content-Security-Policy would block remote ones anyway).
const markdown = new Marked({
  gfm: true,
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
    code({ text, lang }) {
      const language = (lang || '').trim().split(/\s+/)[0].toLowerCase();
      const body = language && hljs.getLanguage(language)
        ? hljs.highlight(text, { language, ignoreIllegals: true }).value
        : escapeHtml(text);
      const cls = language ? ` language-${escapeHtml(language)}` : '';
      return `<pre><button class="copy" type="button">copy</button><code class="hljs${cls}">${body}</code></pre>`;
    },
    link({ href, title, tokens }) {
      const text = this.parser.parseInline(tokens);
      const url = safeUrl(href);
      if (!url) return text;
      const t = title ? ` title="${escapeHtml(title)}"` : '';
      return `<a href="${escapeHtml(url)}"${t} target="_blank" rel="noopener noreferrer">${text}</a>`;
    },
    image({ href, text }) {
      const url = safeUrl(href);
      const label = escapeHtml(text || href || '');
      return url ? `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${label}</a>` : label;
    },
  },
});

// The demo model's weather tool, answered by fakeWeather below.
const WEATHER_TOOL = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Get the current weather for a location.',
    parameters: {
      type: 'object',
      properties: {
        location: { type: 'string', description: 'The city name, e.g. Paris' },
        unit: { type: 'string', enum: ['celsius', 'fahrenheit'], description: 'The temperature unit' },
      },
      required: ['location'],
    },
  },
};

/** Made-up weather, the same for the same place: a demo of a tool round trip. */
function fakeWeather(args) {
  const location = String(args.location || 'somewhere');
  let h = 0;
  for (const ch of location.toLowerCase()) h = (h * 31 + ch.codePointAt(0)) >>> 0;
  const conditions = ['sunny', 'partly cloudy', 'cloudy', 'light rain', 'rain', 'windy', 'foggy', 'snow'];
  const condition = conditions[h % conditions.length];
  let temperature = (condition === 'snow' ? -4 : 6) + (h >>> 3) % 22;
  const unit = args.unit === 'fahrenheit' ? 'fahrenheit' : 'celsius';
  if (unit === 'fahrenheit') temperature = Math.round(temperature * 9 / 5 + 32);
  return {
    location, temperature, unit, condition, humidity: 40 + (h >>> 7) % 50, wind_kph: (h >>> 11) % 35,
  };
}

/** JSON as Python's json.dumps writes it (", " and ": "): the demo model was trained on tool
 * results in that form, and misreads numbers in JSON.stringify's compact one. */
function spacedJson(value) {
  if (Array.isArray(value)) return `[${value.map(spacedJson).join(', ')}]`;
  if (value && typeof value === 'object') {
    return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${spacedJson(v)}`).join(', ')}}`;
  }
  return JSON.stringify(value);
}

function runTool(call) {
  let args = {};
  try {
    args = JSON.parse(call.arguments || '{}');
  } catch {
    return { error: `the arguments are not JSON: ${call.arguments}` };
  }
  if (call.name === 'get_weather') return fakeWeather(args);
  return { error: `this page has no tool named ${call.name}` };
}

// Conversations: [{id, title, messages, updated}], newest first, in local storage.
const STORE = 'sluice.conversations';
let conversations = [];
let current = null;
try {
  conversations = JSON.parse(localStorage.getItem(STORE) || '[]');
} catch {
  conversations = [];
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (e) {
    console.warn('could not save the conversations:', e);
  }
}

function newConversation() {
  if (current && current.messages.length === 0) return;
  current = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: 'New chat', messages: [], updated: Date.now() };
  conversations.unshift(current);
  renderList();
  renderMessages();
}

function renderList() {
  const list = $('#conversations');
  list.replaceChildren();
  for (const conv of conversations) {
    const li = document.createElement('li');
    li.className = conv === current ? 'active' : '';
    const title = document.createElement('span');
    title.textContent = conv.title;
    title.title = conv.title;
    const del = document.createElement('button');
    del.textContent = '×';
    del.title = 'Delete this conversation';
    del.addEventListener('click', (e) => {
      e.stopPropagation();
      if (busy && conv === current) return;
      conversations = conversations.filter((x) => x !== conv);
      save();
      if (conv === current) {
        current = conversations[0] || null;
        if (!current) newConversation();
      }
      renderList();
      renderMessages();
    });
    li.append(title, del);
    li.addEventListener('click', () => {
      if (busy) return;
      current = conv;
      renderList();
      renderMessages();
    });
    list.append(li);
  }
}

function toolBox(kind, label, text) {
  const box = document.createElement('div');
  box.className = `toolbox ${kind}`;
  const l = document.createElement('div');
  l.className = 'label';
  l.textContent = label;
  const code = document.createElement('code');
  code.textContent = text;
  box.append(l, code);
  return box;
}

/** Fills `el` with `msg` (re-run while it streams). */
function renderMessage(el, msg) {
  el.className = `msg ${msg.role}`;
  el.dataset.state = msg.state || 'done';
  const parts = [];
  if (msg.role === 'user') {
    const body = document.createElement('div');
    body.className = 'body';
    body.textContent = msg.content;
    parts.push(body);
  } else if (msg.role === 'tool') {
    parts.push(toolBox('result', `${msg.name} result`, msg.content));
  } else {
    if (msg.reasoning) {
      const details = el.querySelector('details.reasoning') || document.createElement('details');
      details.className = 'reasoning';
      const summary = document.createElement('summary');
      summary.textContent = msg.state === 'streaming' && !msg.content ? 'Thinking…' : `Reasoning (${msg.reasoning.length} characters)`;
      const text = document.createElement('div');
      text.className = 'text';
      text.textContent = msg.reasoning;
      details.replaceChildren(summary, text);
      parts.push(details);
    }
    const body = document.createElement('div');
    body.className = 'body';
    body.innerHTML = markdown.parse(msg.content || '');
    parts.push(body);
    for (const call of msg.tool_calls || []) {
      parts.push(toolBox('call', 'tool call', `${call.name}(${call.arguments})`));
    }
    if (msg.error) {
      const err = document.createElement('div');
      err.className = 'error';
      err.textContent = msg.error;
      parts.push(err);
    }
    const meta = document.createElement('div');
    meta.className = 'meta';
    const bits = [];
    if (msg.tokens) bits.push(`${msg.tokens} tokens`);
    // Tokens after the first over the time since it: an answer that came in one piece has none.
    if (msg.tokens > 1 && msg.secs > 0.05) bits.push(`${((msg.tokens - 1) / msg.secs).toFixed(1)} tok/s`);
    if (msg.finish && msg.finish !== 'stop') bits.push(`finish: ${msg.finish}`);
    meta.textContent = bits.join(' · ');
    if (msg.state === 'stopped') {
      const s = document.createElement('span');
      s.className = 'stopped';
      s.textContent = `${bits.length ? ' · ' : ''}stopped`;
      meta.append(s);
    }
    parts.push(meta);
  }
  el.replaceChildren(...parts);
}

function renderMessages() {
  const box = $('#messages');
  box.replaceChildren();
  if (!current || current.messages.length === 0) {
    const empty = document.createElement('div');
    empty.className = 'empty';
    empty.textContent = 'Ask something. The bundled demo model tells short stories, chats a little and calls a weather tool ("What is the weather in Lisbon?").';
    box.append(empty);
    return;
  }
  for (const msg of current.messages) {
    const el = document.createElement('div');
    renderMessage(el, msg);
    box.append(el);
  }
  box.scrollTop = box.scrollHeight;
}

function appendMessage(msg) {
  const box = $('#messages');
  box.querySelector('.empty')?.remove();
  const el = document.createElement('div');
  renderMessage(el, msg);
  box.append(el);
  box.scrollTop = box.scrollHeight;
  return el;
}

/** The conversation as the API wants it. */
function requestMessages(settings) {
  const out = [];
  if (settings.system.trim()) out.push({ role: 'system', content: settings.system });
  for (const m of current.messages) {
    if (m.role === 'user') out.push({ role: 'user', content: m.content });
    else if (m.role === 'tool') out.push({ role: 'tool', tool_call_id: m.tool_call_id, content: m.content });
    else if (m.content || m.tool_calls?.length) {
      const a = { role: 'assistant', content: m.content || '' };
      if (m.tool_calls?.length) {
        a.tool_calls = m.tool_calls.map((t) => ({ id: t.id, type: 'function', function: { name: t.name, arguments: t.arguments } }));
      }
      out.push(a);
    }
  }
  return out;
}

function requestBody(settings) {
  const body = {
    messages: requestMessages(settings),
    stream: true,
    stream_options: { include_usage: true },
    chat_template_kwargs: { enable_thinking: settings.thinking },
  };
  const num = (v) => (v === '' || v == null ? null : Number(v));
  if (num(settings.temperature) != null) body.temperature = num(settings.temperature);
  if (num(settings.top_p) != null) body.top_p = num(settings.top_p);
  if (num(settings.max_tokens) != null) body.max_tokens = num(settings.max_tokens);
  if (settings.tools) body.tools = [WEATHER_TOOL];
  if (settings.extra) Object.assign(body, JSON.parse(settings.extra));
  return body;
}

/** Yields the JSON of each `data:` event of an SSE response, until `[DONE]`. */
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      yield JSON.parse(data);
    }
  }
}

let busy = false;
let controller = null;
const REDRAW_MS = 50;

function setBusy(on) {
  busy = on;
  $('#send').hidden = on;
  $('#stop').hidden = !on;
}

/** Streams one assistant answer into `msg`; true if it ended normally. */
async function streamAnswer(msg, el, signal) {
  const settings = loadSettings();
  // Re-rendered (Markdown parsed again) at most every REDRAW_MS: a fast model sends hundreds
  // of pieces a second, and the browser may share the machine's cores with the model.
  let pending = false;
  let drawn = 0;
  const draw = () => {
    pending = false;
    drawn = performance.now();
    const box = $('#messages');
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    renderMessage(el, msg);
    if (atEnd) box.scrollTop = box.scrollHeight;
  };
  const redraw = () => {
    if (pending) return;
    pending = true;
    setTimeout(() => requestAnimationFrame(draw), Math.max(0, REDRAW_MS - (performance.now() - drawn)));
  };
  const started = performance.now();
  let first = null;
  let response;
  try {
    response = await api('/v1/chat/completions', {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(requestBody(settings)),
      signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    let chunks = 0;
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) msg.tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.content || d.reasoning_content || d.tool_calls) {
        first ??= performance.now();
        chunks += 1;
      }
      if (d.content) msg.content += d.content;
      if (d.reasoning_content) msg.reasoning += d.reasoning_content;
      for (const t of d.tool_calls || []) {
        const i = t.index ?? msg.tool_calls.length;
        msg.tool_calls[i] ??= { id: t.id, name: '', arguments: '' };
        const call = msg.tool_calls[i];
        if (t.id) call.id = t.id;
        if (t.function?.name) call.name += t.function.name;
        if (t.function?.arguments) call.arguments += t.function.arguments;
      }
      if (choice.finish_reason) msg.finish = choice.finish_reason;
      msg.tokens ||= 0;
      if (!chunk.usage) msg.tokens = Math.max(msg.tokens, chunks);
      msg.secs = (performance.now() - (first ?? started)) / 1000;
      redraw();
    }
    msg.state = 'done';
    return true;
  } catch (e) {
    if (e.name === 'AbortError') {
      msg.state = 'stopped';
    } else {
      msg.state = 'error';
      msg.error = e.message;
    }
    return false;
  } finally {
    renderMessage(el, msg);
  }
}

async function send(text) {
  if (busy || !text.trim()) return;
  if (!current) newConversation();
  const conv = current;
  if (conv.messages.length === 0) conv.title = text.trim().slice(0, 48);
  conv.updated = Date.now();
  const user = { role: 'user', content: text };
  conv.messages.push(user);
  appendMessage(user);
  conversations = [conv, ...conversations.filter((x) => x !== conv)];
  renderList();
  save();
  setBusy(true);
  controller = new AbortController();
  try {
    // A tool call is answered here and the model goes on; a few rounds at most.
    for (let round = 0; round < 4; round += 1) {
      const msg = { role: 'assistant', content: '', reasoning: '', tool_calls: [], state: 'streaming' };
      conv.messages.push(msg);
      const el = appendMessage(msg);
      const ok = await streamAnswer(msg, el, controller.signal);
      save();
      if (!ok || msg.tool_calls.length === 0) break;
      for (const call of msg.tool_calls) {
        const result = { role: 'tool', tool_call_id: call.id, name: call.name, content: spacedJson(runTool(call)) };
        conv.messages.push(result);
        appendMessage(result);
      }
      save();
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

export function initChat() {
  current = conversations[0] || null;
  if (!current) newConversation();
  renderList();
  renderMessages();
  const input = $('#input');
  const grow = () => {
    input.style.height = 'auto';
    input.style.height = `${Math.min(input.scrollHeight, 200)}px`;
  };
  input.addEventListener('input', grow);
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('#composer').requestSubmit();
    }
  });
  $('#composer').addEventListener('submit', (e) => {
    e.preventDefault();
    if (busy) return;
    const text = input.value;
    input.value = '';
    grow();
    send(text);
  });
  $('#stop').addEventListener('click', () => controller?.abort());
  $('#new-chat').addEventListener('click', () => {
    if (!busy) newConversation();
  });
  $('#messages').addEventListener('click', (e) => {
    const button = e.target.closest('pre .copy');
    if (!button) return;
    navigator.clipboard?.writeText(button.parentElement.querySelector('code').textContent);
    button.textContent = 'copied';
    setTimeout(() => { button.textContent = 'copy'; }, 1200);
  });
}
