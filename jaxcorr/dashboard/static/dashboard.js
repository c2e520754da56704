// The dashboard's pages (jaxcorr/dashboard/app.py serves the JSON).
// Every fetch that fails shows its one-line message in #notes.
'use strict';

const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e',
  '#17becf', '#8c564b', '#e377c2'];

async function api(path) {
  const r = await fetch(path);
  let body;
  try { body = await r.json(); } catch (e) { body = {error: r.statusText}; }
  if (!r.ok || body.error) throw new Error(body.error || r.statusText);
  return body;
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'style') e.style.cssText = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}

function note(text, kind) {
  document.getElementById('notes').append(el('div', {class: 'note ' + (kind || '')}, text));
}

function fmt(x) {
  if (x == null) return '–';
  if (typeof x !== 'number') return String(x);
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e4)) return x.toExponential(2);
  return (+x.toFixed(4)).toString();
}

// ------------------------------------------------------------ colours

// A value's background: red above 0, blue below, white at 0, full at
// |x| >= scale (tests/dashboard/test_browser.py checks one token's).
function shade(x, scale) {
  if (x == null || !isFinite(x)) return '';
  const a = Math.min(Math.abs(x) / scale, 1);
  const c = Math.round(255 * (1 - 0.75 * a));
  return x >= 0 ? `rgb(255, ${c}, ${c})` : `rgb(${c}, ${c}, 255)`;
}

// Colour modes of the trajectory view: each token's value and its scale.
const MODES = {
  'log π_old/μ': {value: (r, t) => diff(r.pi_old[t], r.mu[t]), scale: 0.05},
  'log π_θ/μ': {value: (r, t) => diff(r.pi_theta[t], r.mu[t]), scale: 0.05},
  'weight': {value: (r, t) => (r.weight && r.weight[t] != null && r.weight[t] > 0)
    ? Math.log(r.weight[t]) : null, scale: Math.log(2)},
  'staleness': {value: (r, t) => r.staleness[t], scale: 4},
};

function diff(a, b) { return (a == null || b == null) ? null : a - b; }

// ------------------------------------------------------------ charts

function chart(parent, title, runs, keys, names) {
  // One uPlot of `keys` of every run, on the union of their steps;
  // `names`: the runs' names, prefixed to the labels.
  const box = el('div', {class: 'chart', 'data-title': title}, el('h3', {}, title));
  parent.append(box);
  const steps = new Set();
  const lines = [];
  runs.forEach((series, i) => {
    for (const k of keys) {
      const s = series[k];
      if (!s) continue;
      s[0].forEach(x => steps.add(x));
      lines.push({run: i, key: k, map: new Map(s[0].map((x, j) => [x, s[1][j]]))});
    }
  });
  if (!lines.length) {
    box.append(el('p', {class: 'empty'}, 'no ' + keys.join(', ') + ' in these runs'));
    return null;
  }
  const xs = [...steps].sort((a, b) => a - b);
  const data = [xs, ...lines.map(l => xs.map(x => l.map.has(x) ? l.map.get(x) : null))];
  // Several runs: a colour per run, a dash pattern per metric.
  const series = [{label: 'step'}, ...lines.map((l, j) => ({
    label: (names ? names[l.run] + ' · ' : '') + l.key,
    stroke: COLORS[(names ? l.run : j) % COLORS.length],
    dash: names ? DASHES[keys.indexOf(l.key) % DASHES.length] : [],
    spanGaps: true, points: {show: xs.length < 60},
  }))];
  const width = Math.max(box.clientWidth || 560, 320);
  const u = new uPlot({width, height: 220, series,
    scales: {x: {time: false}, y: {range: yRange}},
    axes: [{}, {size: 64, values: (_, vals) => vals.map(fmt)}]}, data, box);
  box.dataset.points = JSON.stringify(data);
  return u;
}

const DASHES = [[], [8, 4], [2, 3], [12, 3, 2, 3]];

// The y range: 5% margins, and a flat or empty series still gets a span
// (uPlot's own range collapses on a constant).
function yRange(u, min, max) {
  if (min == null || max == null) return [0, 1];
  if (min === max) { const d = Math.abs(min) * 0.1 || 1; return [min - d, max + d]; }
  const pad = (max - min) * 0.05;
  return [min - pad, max + pad];
}

function bars(parent, title, labels, values, name) {
  // A histogram as a small HTML bar list (the staleness buckets).
  const box = el('div', {class: 'chart'}, el('h3', {}, title + ' · ' + name));
  const top = Math.max(...values.map(v => v || 0), 1e-9);
  labels.forEach((lab, i) => box.append(el('div', {class: 'bar'},
    el('span', {class: 'lab'}, lab),
    el('span', {class: 'fill', style: `width:${100 * (values[i] || 0) / top}%`}),
    el('span', {class: 'val'}, fmt(values[i])))));
  parent.append(box);
}

// ------------------------------------------------------------ pages

let RUNS = [];

async function loadRuns() {
  RUNS = (await api('/api/runs')).runs;
  const notes = document.getElementById('notes');
  notes.innerHTML = '';
  RUNS.forEach(r => r.notes.forEach(n => note(r.name + ': ' + n, r.status === 'ok' ? '' : 'warn')));
  return RUNS;
}

// The overview's charts: [title, metric patterns] (app.py OVERVIEW).
const OVERVIEW = JSON.parse(document.currentScript.dataset.overview);
const HISTOGRAMS = document.currentScript.dataset.histograms;

async function overview() {
  const app = document.getElementById('app');
  await loadRuns();
  const keys = OVERVIEW.flatMap(([, k]) => k);
  const data = (await api('/api/series?keys=' + encodeURIComponent(keys.join(',')))).runs;
  const latest = (await api('/api/latest?keys=' + encodeURIComponent(HISTOGRAMS))).runs;
  app.innerHTML = '';
  app.append(el('p', {class: 'runs'}, ...RUNS.map((r, i) => el('span',
    {class: 'run', style: `border-color:${COLORS[i % COLORS.length]}`},
    `${r.name}: ${r.status === 'ok' ? 'step ' + r.last_step : r.status}`))));
  const grid = el('div', {class: 'grid'});
  app.append(grid);
  for (const [title, pats] of OVERVIEW) {
    const expand = data.map(s => Object.keys(s).filter(k => pats.some(p => glob(p, k))));
    const ks = [...new Set(expand.flat())];
    chart(grid, title, data, ks.length ? ks : pats,
      RUNS.length > 1 ? RUNS.map(r => r.name) : null);
  }
  latest.forEach((last, i) => {
    const ks = Object.keys(last).sort();
    if (ks.length) bars(grid, 'Staleness histogram (last step)', ks.map(k => k.replace('staleness/', '')),
      ks.map(k => last[k]), RUNS[i].name);
  });
}

function glob(p, k) {
  const re = new RegExp('^' + p.split('*').map(s => s.replace(/[.+?^${}()|[\]\\/]/g, '\\$&')).join('.*') + '$');
  return re.test(k);
}

// ---------------------------------------------------- trajectories

async function trajectory() {
  const app = document.getElementById('app');
  await loadRuns();
  app.innerHTML = '';
  const runSel = el('select', {id: 'run'}, ...RUNS.map((r, i) => el('option', {value: i}, r.name)));
  const stepSel = el('select', {id: 'step'});
  const modeSel = el('select', {id: 'mode'}, ...Object.keys(MODES).map(m => el('option', {value: m}, m)));
  const sortSel = el('select', {id: 'sort'},
    ...['mismatch_max', 'mismatch_mean', 'rejected', 'reward', 'row'].map(s => el('option', {value: s}, 'sort: ' + s)));
  const rows = el('table', {id: 'rows', class: 'list'});
  const stats = el('div', {id: 'step-stats'});
  const tokens = el('div', {id: 'tokens'});
  app.append(el('div', {class: 'controls'}, runSel, stepSel, modeSel, sortSel),
    el('div', {class: 'split'}, el('div', {class: 'left'}, stats, rows), tokens));
  let summaries = [], current = null;

  async function loadSteps() {
    const t = await api('/api/traces?run=' + runSel.value);
    stepSel.innerHTML = '';
    t.steps.slice().reverse().forEach(s => stepSel.append(el('option', {value: s}, 'step ' + s)));
    samples(app, runSel.value, t.eval_steps);
    if (!t.steps.length) {
      rows.innerHTML = '';
      tokens.innerHTML = '';
      tokens.append(el('p', {class: 'empty'}, 'no traces in this run (train.trace_every=N keeps them)'));
      return;
    }
    await loadRows();
  }
  async function loadRows() {
    const res = await api(`/api/trace?run=${runSel.value}&step=${stepSel.value}`);
    summaries = res.rows;
    drawStats(res.summary);
    drawRows();
    if (summaries.length) await loadRow(summaries[0].row);
  }
  function drawStats(s) {
    // The traced tokens of the step: weight and log-ratio quantiles, and
    // the staleness histogram.
    stats.innerHTML = '';
    const q = (name, v) => v ? `${name} p5 ${fmt(v.p5)} · p50 ${fmt(v.p50)} · p95 ${fmt(v.p95)}` : `${name}: –`;
    stats.append(el('p', {class: 'meta'}, q('weight', s.weight)), el('p', {class: 'meta'}, q('log π_old/μ', s.log_ratio)));
    const ks = Object.keys(s.staleness);
    if (ks.length) bars(stats, 'Staleness of the traced tokens', ks.map(k => 'staleness ' + k), ks.map(k => s.staleness[k]), 'step ' + stepSel.value);
  }
  function drawRows() {
    const key = sortSel.value;
    summaries.sort((a, b) => key === 'row' ? a.row - b.row : (b[key] || 0) - (a[key] || 0));
    rows.innerHTML = '';
    rows.append(el('tr', {}, ...['row', 'reward', 'max |log π_old/μ|', 'rejected', 'tokens'].map(h => el('th', {}, h))));
    for (const s of summaries) rows.append(el('tr', {class: 'pick', 'data-row': s.row, onclick: () => loadRow(s.row)},
      el('td', {}, s.row), el('td', {}, fmt(s.reward)), el('td', {}, fmt(s.mismatch_max)),
      el('td', {}, s.rejected), el('td', {}, s.tokens)));
  }
  async function loadRow(row) {
    current = await api(`/api/trace_row?run=${runSel.value}&step=${stepSel.value}&row=${row}`);
    drawTokens();
  }
  function drawTokens() {
    tokens.innerHTML = '';
    const r = current;
    if (!r) return;
    const mode = MODES[modeSel.value];
    const comps = Object.entries(r.rewards || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(', ');
    tokens.append(el('p', {class: 'meta'}, `row ${r.row} · group ${r.group} · sample ${r.sample} · ${r.finish} · reward ${fmt(r.reward)}` +
      (comps ? ` (${comps})` : '') + ` · advantage ${fmt(r.advantage.find(a => a != null))}`),
    el('pre', {class: 'prompt'}, r.prompt));
    const line = el('div', {class: 'toks'});
    r.ids.forEach((id, t) => {
      const v = mode.value(r, t);
      const cls = ['tok', r.agent[t] ? 'agent' : 'env'];
      if (r.reason[t]) cls.push('why-' + r.reason[t]);
      const tip = [`id ${id}`, `μ ${fmt(r.mu[t])}`, `π_old ${fmt(r.pi_old[t])}`, `π_θ ${fmt(r.pi_theta[t])}`,
        `weight ${fmt(r.weight ? r.weight[t] : null)}`, `staleness ${fmt(r.staleness[t])}`,
        `advantage ${fmt(r.advantage[t])}`, r.reason[t] ? 'not trained: ' + r.reason[t] : 'trains'].join('\n');
      line.append(el('span', {class: cls.join(' '), 'data-t': t, 'data-value': v == null ? '' : v,
        title: tip, style: `background:${shade(v, mode.scale) || 'transparent'}`}, r.pieces[t]));
    });
    tokens.append(line, el('p', {class: 'legend'},
      `colour: ${modeSel.value} (red > 0, blue < 0, full at ±${fmt(mode.scale)}); grey italic: environment tokens; struck: not trained (hover for why)`));
  }
  runSel.onchange = loadSteps;
  stepSel.onchange = loadRows;
  sortSel.onchange = drawRows;
  modeSel.onchange = drawTokens;
  await loadSteps();
}

function samples(app, run, steps) {
  let box = document.getElementById('samples');
  if (box) box.remove();
  box = el('section', {id: 'samples'}, el('h2', {}, 'Eval samples'));
  app.append(box);
  if (!steps.length) { box.append(el('p', {class: 'empty'}, 'no eval samples in this run')); return; }
  const stepSel = el('select', {id: 'eval-step'}, ...steps.slice().reverse().map(s => el('option', {value: s}, 'step ' + s)));
  const q = el('input', {id: 'q', placeholder: 'search prompt, answer, reply'});
  const out = el('div', {id: 'hits'});
  box.append(el('div', {class: 'controls'}, stepSel, q), out);
  async function search() {
    const res = await api(`/api/samples?run=${run}&step=${stepSel.value}&q=${encodeURIComponent(q.value)}`);
    out.innerHTML = '';
    out.append(el('p', {}, `${res.matches} match(es)`));
    const t = el('table', {class: 'list'}, el('tr', {}, ...['set', 'mode', 'sample', 'prompt', 'answer', 'reply', 'reward'].map(h => el('th', {}, h))));
    res.rows.forEach(r => t.append(el('tr', {}, ...[r.set, r.mode, r.sample, r.prompt, r.answer, r.reply, fmt(r.reward)].map(v => el('td', {}, v)))));
    out.append(t);
  }
  stepSel.onchange = search;
  q.oninput = () => { clearTimeout(q._t); q._t = setTimeout(() => search().catch(e => note(e.message, 'error')), 200); };
  search().catch(e => note(e.message, 'error'));
}

// ------------------------------------------------------------- lab

const LAB_COLS = ['mismatch', 'preset', 'seed', 'initial_accuracy', 'final_accuracy', 'peak_accuracy',
  'reward_last20', 'max_k3_kl', 'mean_chi2_token', 'rejected_token_fraction', 'collapsed'];

async function lab() {
  const app = document.getElementById('app');
  const folders = (await api('/api/lab')).folders;
  app.innerHTML = '';
  if (!folders.length) { app.append(el('p', {class: 'empty'}, 'no lab results (python -m jaxcorr.lab writes them; --lab names the folder)')); return; }
  const sel = el('select', {id: 'folder'}, ...folders.map((f, i) => el('option', {value: i}, f.name)));
  const filter = el('input', {id: 'filter', placeholder: 'filter: preset or mismatch'});
  const metric = el('select', {id: 'curve'});
  const table = el('table', {id: 'lab-table', class: 'list'});
  const plot = el('div', {id: 'lab-plot'});
  app.append(el('div', {class: 'controls'}, sel, filter, metric), table, plot);
  let sortKey = 'final_accuracy', desc = true;
  const chosen = new Set();
  const rows = () => folders[sel.value].runs.map((r, i) => ({i, ...r, ...r.summary}));
  function draw() {
    const q = filter.value.toLowerCase();
    const rs = rows().filter(r => !q || (r.preset + ' ' + r.mismatch).toLowerCase().includes(q));
    rs.sort((a, b) => (a[sortKey] > b[sortKey] ? 1 : a[sortKey] < b[sortKey] ? -1 : 0) * (desc ? -1 : 1));
    table.innerHTML = '';
    table.append(el('tr', {}, el('th', {}, 'plot'), ...LAB_COLS.map(c => el('th', {class: 'sortable', onclick: () => {
      desc = sortKey === c ? !desc : true; sortKey = c; draw(); }}, c + (c === sortKey ? (desc ? ' ▼' : ' ▲') : '')))));
    for (const r of rs) {
      const box = el('input', {type: 'checkbox', onchange: e => { e.target.checked ? chosen.add(r.i) : chosen.delete(r.i); curves(); }});
      box.checked = chosen.has(r.i);
      table.append(el('tr', {}, el('td', {}, box), ...LAB_COLS.map(c => el('td', {}, fmt(r[c])))));
    }
  }
  function curves() {
    plot.innerHTML = '';
    const runs = folders[sel.value].runs;
    const ks = [...new Set(runs.flatMap(r => Object.keys(r.curves || {})))].sort();
    if (!metric.options.length || metric.dataset.folder !== sel.value) {
      metric.innerHTML = '';
      ks.forEach(k => metric.append(el('option', {value: k}, k)));
      metric.dataset.folder = sel.value;
      if (ks.includes('reward/mean')) metric.value = 'reward/mean';
    }
    const picked = chosen.size ? [...chosen] : runs.map((_, i) => i).slice(0, 4);
    const series = picked.map(i => {
      const c = (runs[i].curves || {})[metric.value] || [];
      return {[`${runs[i].mismatch} · ${runs[i].preset} · s${runs[i].seed}`]: [c.map(p => p[0]), c.map(p => p[1])]};
    });
    chart(plot, metric.value + (chosen.size ? '' : ' (first 4 runs; tick rows to choose)'), series,
      [...new Set(series.flatMap(Object.keys))], null);
  }
  sel.onchange = () => { chosen.clear(); draw(); curves(); };
  filter.oninput = draw;
  metric.onchange = curves;
  draw();
  curves();
}

// ------------------------------------------------------------- main

async function main() {
  const page = document.body.dataset.page;
  const fn = {'/': overview, '/trajectory': trajectory, '/lab': lab}[page];
  try {
    await fn();
  } catch (e) {
    note(e.message, 'error');
  }
  document.body.dataset.ready = '1';
  if (page === '/') {
    // Live: redraw from what the run appended (the server tails the file).
    setInterval(() => overview().catch(e => note(e.message, 'error')),
      1000 * +document.body.dataset.poll);
  }
}

window.addEventListener('DOMContentLoaded', main);
