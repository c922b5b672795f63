// The expert view: what the expert store does while the model answers, from /stats/stream
// (a JSON snapshot every 250 ms; see the README's "Live statistics"). Connected only while
// the view is open.
import { $, formatBytes } from './util.js';

// Each expert's byte in `experts.map` (sluice_store::ExpertMap): in the cache now (bit 0), its
// last event (bits 1-3: HIT ... EVICTED) and whether that came since the last snapshot (bit 4).
const IN_CACHE = 1;
const FRESH = 16;
const HIT = 1;
const READ_AHEAD = 2;
const DEMAND_READ = 3;
const EVICTED = 4;
// An event's colour fades over this many snapshots (1 s).
const FADE = 4;
// Seconds of history in the plots.
const HISTORY = 120;

// The theme's colours, read once per scheme (reading styles at every snapshot forces the
// browser to recompute them).
let colours = {};
const css = (name) => {
  colours[name] ??= getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return colours[name];
};
window.matchMedia('(prefers-color-scheme: dark)').addEventListener('change', () => { colours = {}; });

const KINDS = [
  { event: HIT, name: 'hit', color: '--hit' },
  { event: READ_AHEAD, name: 'read ahead', color: '--ahead' },
  { event: DEMAND_READ, name: 'read on demand', color: '--demand' },
  { event: EVICTED, name: 'evicted', color: '--evicted' },
];

function legend(el, items) {
  el.replaceChildren(...items.map(([color, text]) => {
    const span = document.createElement('span');
    const swatch = document.createElement('i');
    swatch.style.background = color;
    span.append(swatch, text);
    return span;
  }));
}

const pct = (x) => (x == null ? '–' : `${(x * 100).toFixed(x >= 0.995 || x === 0 ? 0 : 1)}%`);

export function initExperts() {
  let source = null;
  let snapshots = 0;
  // Per cell: the last event's bit and the snapshots since.
  let lastEvent = null;
  let age = null;
  const history = [[], [], [], [], []];
  let plots = null;

  legend($('#map-legend'), [
    [css('--empty'), 'not in the cache'],
    [css('--cached'), 'in the cache'],
    ...KINDS.map((k) => [css(k.color), k.name]),
  ]);

  function status(text, resident = false) {
    const el = $('#ex-status');
    el.textContent = text;
    el.className = resident ? 'resident' : '';
  }

  function drawMap(s) {
    const canvas = $('#expert-map');
    const rows = s.experts.map;
    const cols = Math.max(...rows.map((r) => r.length));
    const cells = rows.length * cols;
    if (!lastEvent || lastEvent.length !== cells) {
      lastEvent = new Uint8Array(cells);
      age = new Uint8Array(cells).fill(255);
    }
    const width = Math.max(200, $('#map-wrap').clientWidth - 4);
    const label = rows.length > 1 ? 34 : 0;
    const size = Math.max(3, Math.min(22, Math.floor((width - label) / cols)));
    const gap = size >= 8 ? 1 : 0;
    const w = label + cols * size;
    const h = rows.length * size;
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
      canvas.style.width = `${w}px`;
      canvas.style.height = `${h}px`;
    }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const colors = {
      empty: css('--empty'), cached: css('--cached'), muted: css('--muted'),
    };
    for (const k of KINDS) colors[k.event] = css(k.color);
    ctx.font = `${Math.min(11, size)}px system-ui, sans-serif`;
    ctx.textBaseline = 'middle';
    rows.forEach((row, r) => {
      if (label && size >= 7 && (rows.length <= 24 || r % Math.ceil(rows.length / 24) === 0)) {
        ctx.fillStyle = colors.muted;
        ctx.fillText(`L${s.experts.layers[r]}`, 0, r * size + size / 2);
      }
      for (let e = 0; e < row.length; e += 1) {
        const bits = parseInt(row[e], 32);
        const i = r * cols + e;
        const event = (bits >> 1) & 7;
        if (bits & FRESH && colors[event]) {
          lastEvent[i] = event;
          age[i] = 0;
        } else if (age[i] < 255) {
          age[i] += 1;
        }
        const x = label + e * size;
        const y = r * size;
        ctx.globalAlpha = 1;
        ctx.fillStyle = bits & IN_CACHE ? colors.cached : colors.empty;
        ctx.fillRect(x, y, size - gap, size - gap);
        if (age[i] < FADE) {
          // A fresh event colours the cell, fading; an eviction only outlines it (the cell says
          // "not in the cache"), or with a small cache most of the map would be red.
          ctx.globalAlpha = 1 - age[i] / FADE;
          const c = colors[lastEvent[i]];
          if (lastEvent[i] === EVICTED) {
            const w = Math.max(1, Math.floor(size / 6));
            ctx.strokeStyle = c;
            ctx.lineWidth = w;
            ctx.strokeRect(x + w / 2, y + w / 2, size - gap - w, size - gap - w);
          } else {
            ctx.fillStyle = c;
            ctx.fillRect(x, y, size - gap, size - gap);
          }
        }
      }
    });
    ctx.globalAlpha = 1;
    canvas.dataset.map = rows.join('|');
    canvas.dataset.snapshots = String(snapshots);
    $('#map-caption').textContent = `${rows.length} layers × ${cols} experts: what last happened to each expert, fading over a second; under it, whether the expert is in the cache now.`;
  }

  // The process's memory, split; what the machine has left is said beside it.
  function drawMemory(s) {
    const m = s.memory;
    const used = s.streaming ? m.expert_cache_used : 0;
    const reserved = s.streaming ? Math.max(0, m.expert_cache - m.expert_cache_used) : 0;
    const other = m.rss != null ? Math.max(0, m.rss - m.weights - used) : 0;
    const parts = [
      [css('--weights'), s.streaming ? 'resident weights' : 'weights (every expert resident)', m.weights],
      [css('--cache'), 'expert cache, filled', used],
      [css('--cached'), 'expert cache, not filled yet', reserved],
      [css('--other'), 'rest of the process (request states, buffers)', other],
    ].filter((p) => p[2] > 0 || (s.streaming && p[1] === 'expert cache, filled'));
    const total = parts.reduce((a, p) => a + p[2], 0) || 1;
    $('#memory-bar').replaceChildren(...parts.map(([color, name, bytes]) => {
      const d = document.createElement('div');
      d.style.background = color;
      d.style.width = `${(bytes / total) * 100}%`;
      d.title = `${name}: ${formatBytes(bytes)}`;
      return d;
    }));
    const items = parts.map(([color, name, bytes]) => [color, `${name} ${formatBytes(bytes)}`]);
    if (m.available != null) items.push([css('--free'), `available on this machine ${formatBytes(m.available)}`]);
    legend($('#memory-legend'), items);
  }

  function plotOptions(title, series, width) {
    const axis = { stroke: css('--muted'), grid: { stroke: css('--line'), width: 1 }, ticks: { stroke: css('--line') } };
    return {
      title,
      width,
      height: 170,
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: false } },
      axes: [
        { ...axis, values: (u, ticks) => ticks.map((t) => `${t.toFixed(0)}s`) },
        { ...axis, scale: series[0].scale, size: 50 },
        { ...axis, scale: series[1].scale, side: 1, grid: { show: false }, size: 50 },
      ],
      series: [{ label: 'time', value: (u, v) => (v == null ? '–' : `${v.toFixed(1)} s`) }, ...series],
    };
  }

  function ensurePlots() {
    if (plots || typeof uPlot === 'undefined') return;
    const el1 = $('#plot-speed');
    const el2 = $('#plot-cache');
    const width = Math.max(240, el1.clientWidth - 8);
    const num = (d) => (u, v) => (v == null ? '–' : v.toFixed(d));
    plots = [
      new uPlot(plotOptions('speed', [
        { label: 'tok/s', stroke: css('--accent'), width: 2, scale: 'tok', value: num(1) },
        { label: 'read GB/s', stroke: css('--demand'), width: 2, scale: 'gb', value: num(2) },
      ], width), [history[0], history[1], history[2]], el1),
      new uPlot(plotOptions('cache', [
        { label: 'hit rate %', stroke: css('--hit'), width: 2, scale: '%', value: num(1) },
        { label: 'I/O wait %', stroke: css('--evicted'), width: 2, scale: '%', value: num(1) },
      ], width), [history[0], history[3], history[4]], el2),
    ];
    new ResizeObserver(() => {
      const w = Math.max(240, el1.clientWidth - 8);
      for (const p of plots) p.setSize({ width: w, height: 170 });
    }).observe(el1);
  }

  function drawPlots(s) {
    if (!s.rates) return;
    const r = s.rates;
    const cols = [s.time, r.tok_s, r.read_gb_s, r.hit_rate == null ? null : r.hit_rate * 100, r.io_wait * 100];
    cols.forEach((v, i) => history[i].push(v));
    while (history[0].length && history[0][0] < s.time - HISTORY) for (const h of history) h.shift();
    ensurePlots();
    if (plots) {
      plots[0].setData([history[0], history[1], history[2]]);
      plots[1].setData([history[0], history[3], history[4]]);
    }
  }

  function drawTiles(s) {
    const r = s.rates;
    $('#tile-toks').textContent = r ? r.tok_s.toFixed(1) : '–';
    $('#tile-read').textContent = r && s.streaming ? r.read_gb_s.toFixed(2) : '–';
    $('#tile-hit').textContent = r && s.streaming ? pct(r.hit_rate) : '–';
    $('#tile-wait').textContent = r && s.streaming ? pct(r.io_wait) : '–';
    $('#tile-running').textContent = `${s.requests.running}${s.requests.queued ? ` +${s.requests.queued}` : ''}`;
  }

  function drawTotals(s) {
    const st = s.store;
    const lines = [`${s.tokens.generated} tokens generated; ${s.requests.finished} requests finished, ${s.requests.cancelled} cancelled.`];
    if (st) {
      lines.push(`Experts asked for ${st.requests}: ${st.hits} found in the cache, ${st.prefetch_hits} already being read ahead, ${st.misses} read on demand (hit rate ${pct(st.hit_rate)}).`);
      lines.push(`Read ${formatBytes(st.bytes_read)} in ${st.blocks_read} blocks; ${st.prefetch_issued} read ahead, ${st.prefetch_useful} of them used; ${st.evictions} evictions; ${st.errors} read errors; ${st.io_wait_secs.toFixed(2)} s waiting on reads.`);
    }
    $('#ex-totals').replaceChildren(...lines.map((t) => {
      const p = document.createElement('div');
      p.textContent = t;
      return p;
    }));
  }

  function update(s) {
    snapshots += 1;
    if (s.streaming) {
      const m = s.memory;
      const share = m.experts_total ? ` (${pct(m.expert_cache / m.experts_total)} of the experts' ${formatBytes(m.experts_total)})` : '';
      status(`${s.model} on ${s.device}: ${s.layers} layers of ${s.experts_per_layer} experts, ${s.experts_per_token} per token, streaming from disk (${s.store.io}). Expert cache ${formatBytes(m.expert_cache)} in ${s.store.slots} slots${share}, sized by ${m.plan}.`);
    } else {
      status(`${s.model}: every expert is resident in memory, so nothing streams and there is no expert cache to show. Start sluice serve with --expert-cache SIZE or --memory-budget SIZE (or on a model packed with sluice pack) to stream experts from disk.`, true);
    }
    $('#expert-map').hidden = !s.experts;
    if (s.experts) drawMap(s);
    drawMemory(s);
    drawTiles(s);
    drawPlots(s);
    drawTotals(s);
  }

  function setVisible(on) {
    if (on && !source) {
      source = new EventSource('/stats/stream');
      source.onmessage = (e) => update(JSON.parse(e.data));
      source.onerror = () => status('The statistics stream was interrupted; reconnecting…');
    } else if (!on && source) {
      source.close();
      source = null;
    }
  }

  return { setVisible };
}
