// rlpipe view: the page asks its server (rlpipe/reports/serve.py) for one page of rows at a time, a sample's
// token view when a row is clicked, and one prompt across iterations. The state lives in the URL's hash
// (#where=...&sort=...&sample=3:1), so a view can be reloaded, bookmarked and sent as a link.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { where: "", search: "", sort: "", desc: false, color: "", offset: 0, limit: 50, sample: "", prompt: "" };
let info = null;

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const key of Object.keys(state)) {
    if (!params.has(key)) continue;
    const raw = params.get(key);
    state[key] = typeof state[key] === "number" ? (parseInt(raw, 10) || 0) : key === "desc" ? raw === "1" : raw;
  }
}

function writeHash() {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(state)) {
    if (value === "" || value === false || (key === "offset" && value === 0)) continue;
    params.set(key, value === true ? "1" : String(value));
  }
  history.replaceState(null, "", "#" + params.toString());
}

async function api(path, params) {
  const response = await fetch(path + "?" + new URLSearchParams(params || {}));
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function showError(error) {
  $("error").hidden = !error;
  $("error").textContent = error ? "error: " + error.message : "";
}

// The text with each case-insensitive occurrence of the search words in a <mark>.
function highlighted(text, words) {
  const out = document.createDocumentFragment();
  const parts = words ? text.split(new RegExp("(" + words.replace(/[.*+?^${}()|[\]\\]/g, "\\$&") + ")", "gi")) : [text];
  parts.forEach((part, i) => {
    if (i % 2) {
      const mark = document.createElement("mark");
      mark.textContent = part;
      out.appendChild(mark);
    } else {
      out.appendChild(document.createTextNode(part));
    }
  });
  return out;
}

function cell(name, value, dtype, chars, from) {
  const td = document.createElement("td");
  td.dataset.column = name;
  if (value === null || value === undefined) {
    td.textContent = "-";
    td.className = "dim";
  } else if (dtype.startsWith("Float")) {
    td.textContent = value.toFixed(4);
    td.className = "num";
  } else if (dtype === "Boolean") {
    td.textContent = value ? "true" : "false";
    if (name === "correct") td.className = "bool-" + value; // green/red only where true is the good side
  } else if (dtype === "String") {
    // a few lines of the text (the token view has all of it), and its full length when it was cut
    const clip = document.createElement("div");
    clip.className = "clip";
    if (from > 0) clip.appendChild(document.createTextNode("… ")); // the text around the search hit
    clip.appendChild(highlighted(value, name === "completion_text" ? state.search : ""));
    td.className = "text";
    td.appendChild(clip);
    if (chars > value.length || from > 0) {
      const more = document.createElement("div");
      more.className = "more";
      more.textContent = `… ${chars} characters`;
      td.appendChild(more);
    }
  } else {
    td.textContent = String(value);
    td.className = /Int/.test(dtype) ? "num" : "";
  }
  return td;
}

function drawTable(page) {
  const columns = Object.entries(page.columns);
  const head = document.createElement("tr");
  for (const [name] of columns) {
    const th = document.createElement("th");
    th.textContent = name + (state.sort === name ? (state.desc ? " ↓" : " ↑") : "");
    th.className = state.sort === name ? "sorted" : "";
    th.title = (info.docs[name] ? info.docs[name] + "\n" : "") + "click: sort by " + name + " (again: reverse)";
    th.onclick = () => {
      state.desc = state.sort === name ? !state.desc : false;
      state.sort = name;
      state.offset = 0;
      syncControls();
      loadRows();
    };
    head.appendChild(th);
  }
  $("rows").tHead.replaceChildren(head);
  const body = $("rows").tBodies[0];
  body.replaceChildren(...page.rows.map((row) => {
    const tr = document.createElement("tr");
    tr.dataset.promptId = row.prompt_id;
    tr.dataset.sampleIdx = row.sample_idx;
    if (state.sample === `${row.prompt_id}:${row.sample_idx}`) tr.className = "open";
    for (const [name, dtype] of columns) tr.appendChild(cell(name, row[name], dtype, row[name + "_chars"], row[name + "_from"] || 0));
    tr.onclick = () => openSample(row.prompt_id, row.sample_idx);
    return tr;
  }));
  const last = Math.min(page.offset + page.rows.length, page.matched);
  $("range").textContent = page.matched === 0 ? `no rows match (of ${page.total})`
    : `rows ${page.offset + 1}–${last} of ${page.matched} matched (${page.total} in all)`;
  $("prev").disabled = page.offset === 0;
  $("next").disabled = last >= page.matched;
}

async function loadRows() {
  writeHash();
  try {
    const page = await api("/api/rows", { where: state.where, search: state.search, sort: state.sort,
                                          desc: state.desc ? "1" : "", offset: state.offset, limit: state.limit });
    showError(null);
    drawTable(page);
  } catch (error) {
    showError(error);
    $("rows").tBodies[0].replaceChildren();
    $("range").textContent = "";
  }
}

async function openSample(promptId, sampleIdx) {
  state.sample = `${promptId}:${sampleIdx}`;
  writeHash();
  for (const tr of $("rows").tBodies[0].rows) {
    tr.className = `${tr.dataset.promptId}:${tr.dataset.sampleIdx}` === state.sample ? "open" : "";
  }
  try {
    const sample = await api("/api/sample", { prompt_id: promptId, sample_idx: sampleIdx, color_by: state.color });
    $("sample-title").textContent = `prompt ${promptId}, sample ${sampleIdx}` +
      (sample.answer !== null && sample.answer !== undefined ? ` (answer ${sample.answer})` : "");
    $("sample-prompt").textContent = sample.prompt || "";
    $("sample-body").innerHTML = sample.html; // drawn and escaped by rlpipe.reports.html, as inspect's page is
    $("follow").onclick = () => openPrompt(promptId);
    $("sample").hidden = false;
    showError(null);
  } catch (error) {
    showError(error);
  }
}

function historyTable(entry, current) {
  const wrap = document.createElement("div");
  const title = document.createElement("h3");
  title.textContent = entry.iteration + (entry.iteration === current ? " (this one)" : "") +
    (entry.policy_version !== null ? ` · policy version ${entry.policy_version}` : "");
  wrap.appendChild(title);
  if (entry.note) {
    const note = document.createElement("p");
    note.className = "dim";
    note.textContent = entry.note;
    wrap.appendChild(note);
  }
  if (!entry.rows.length) return wrap;
  const table = document.createElement("table");
  table.className = "history";
  table.dataset.iteration = entry.iteration;
  const names = Object.keys(entry.columns);
  const head = document.createElement("tr");
  for (const name of names) {
    const th = document.createElement("th");
    th.textContent = name;
    head.appendChild(th);
  }
  table.appendChild(head);
  for (const row of entry.rows) {
    const tr = document.createElement("tr");
    for (const name of names) tr.appendChild(cell(name, row[name], entry.columns[name], 0, 0));
    table.appendChild(tr);
  }
  wrap.appendChild(table);
  return wrap;
}

async function openPrompt(promptId) {
  state.prompt = String(promptId);
  writeHash();
  $("history-title").textContent = `prompt ${promptId} in every iteration`;
  $("history-body").textContent = "reading…";
  $("history").hidden = false;
  try {
    const history = await api("/api/prompt", { prompt_id: promptId });
    $("history-body").replaceChildren(...history.iterations.map((e) => historyTable(e, history.current)));
    showError(null);
  } catch (error) {
    $("history-body").textContent = "";
    showError(error);
  }
}

function syncControls() {
  $("where").value = state.where;
  $("search").value = state.search;
  $("sort").value = state.sort;
  $("desc").checked = state.desc;
  $("color").value = state.color;
  $("limit").value = String(state.limit);
}

function addOptions(select, names) {
  for (const name of names) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    select.appendChild(option);
  }
}

async function start() {
  readHash();
  try {
    info = await api("/api/info");
  } catch (error) {
    showError(error);
    return;
  }
  $("title").textContent = `rlpipe view: ${info.label} (${info.view} view)`;
  document.title = `rlpipe view: ${info.label}`;
  $("source").textContent = `${info.total} rows · ` + Object.entries(info.files).map(([r, f]) => `${r}: ${f}`).join(" · ") +
    (info.tokenizer ? ` · tokenizer ${info.tokenizer}` : " · no tokenizer.json found: tokens from the stored text");
  $("warnings").replaceChildren(...info.warnings.map((w) => {
    const p = document.createElement("p");
    p.className = "warn";
    p.textContent = "warning: " + w;
    return p;
  }));
  addOptions($("sort"), Object.entries(info.columns).filter(([, t]) => !/^(List|Array|Struct)/.test(t)).map(([c]) => c));
  addOptions($("color"), info.color_columns);
  if (![25, 50, 100, 200].includes(state.limit)) addOptions($("limit"), [String(state.limit)]);
  syncControls();
  $("controls").onsubmit = (event) => {
    event.preventDefault();
    Object.assign(state, { where: $("where").value.trim(), search: $("search").value.trim(), sort: $("sort").value,
                           desc: $("desc").checked, color: $("color").value, limit: parseInt($("limit").value, 10),
                           offset: 0 });
    loadRows();
    if (state.sample) openSample(...state.sample.split(":"));
  };
  $("prev").onclick = () => { state.offset = Math.max(0, state.offset - state.limit); loadRows(); };
  $("next").onclick = () => { state.offset += state.limit; loadRows(); };
  const work = [loadRows()];
  if (state.sample) work.push(openSample(...state.sample.split(":")));
  if (state.prompt) work.push(openPrompt(state.prompt));
  await Promise.all(work);
  document.body.dataset.ready = "1";
}

start();
