"""The script of an inspect page: it inflates the packed tokens (rlpipe.reports.packed) and draws them on demand.

Kept apart from rlpipe.reports.html so the drawing rules read in one place: a sample's tokens are drawn
when its placeholder (``<div class="completion" data-row="K">``) comes near the screen, the first
``eager_tokens`` of the page at once; a sample's per-token table when its ``<details>`` is opened.
Each token is a ``<span class="tok">`` coloured on the page's scale (the colours of
rlpipe.reports.render.token_color, computed here from the value), with every carried value in its
tooltip; a newline token also breaks the line; the least likely sampled tokens carry ``data-low``
(their rank). A multi-turn rollout is drawn as rlpipe.reports.html.completion_html draws it: the
environment's tokens ``tok obs`` in the observation grey whatever the colouring, a ``turn-sep`` line
(the turn, its tool calls and their status) before each reply, a ``turn-start`` line where the next
model turn begins (the lines' texts come with the tokens, from rlpipe.reports.turn_view).
The browser's own DecompressionStream inflates the data: no network, no library.
"""

SCRIPT = r"""
(function () {
  "use strict";
  const packNode = document.getElementById("rlpipe-tokens");
  const viewNode = document.getElementById("rlpipe-view");
  if (!packNode || !viewNode) return;
  const pack = JSON.parse(packNode.textContent);
  const view = JSON.parse(viewNode.textContent);
  const digits = {f4: 6, f2: 3, q8: 2}[pack.dtype];  // what float32, float16 and one byte of log-magnitude hold

  function fromBase64(b64) {  // the browser's own decoder where it has one (Chromium 140+, Firefox 133+)
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(b64);
    const bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return bytes;
  }
  async function inflate(b64) {
    const bytes = fromBase64(b64);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  function unplane(bytes, k) {  // byte planes (all first bytes, then all second bytes...) back to values
    const n = bytes.length / k, out = new Uint8Array(bytes.length);
    for (let b = 0; b < k; b++) {
      const base = b * n;
      for (let i = 0; i < n; i++) out[i * k + b] = bytes[base + i];
    }
    return out.buffer;
  }
  let halfTable = null;
  function halves(buffer) {
    if (!halfTable) {
      halfTable = new Float32Array(65536);
      for (let h = 0; h < 65536; h++) {
        const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 31, f = h & 1023;
        halfTable[h] = e === 0 ? s * f * Math.pow(2, -24)
          : e === 31 ? (f ? NaN : s * Infinity) : s * (1 + f / 1024) * Math.pow(2, e - 15);
      }
    }
    const raw = new Uint16Array(buffer), out = new Float32Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = halfTable[raw[i]];
    return out;
  }

  function unlog8(codes, scale) {  // rlpipe.reports.packed.unlog8
    const table = new Float64Array(256);
    for (let c = 1; c < 255; c++) {
      const magnitude = Math.pow(2, scale[0] + (c >= 128 ? c - 128 : c - 1) * scale[1]);
      table[c] = c >= 128 ? -magnitude : magnitude;
    }
    table[255] = NaN;
    const out = new Float64Array(codes.length);
    for (let i = 0; i < codes.length; i++) out[i] = table[codes[i]];
    return out;
  }

  function g(v) {  // Python's f"{v:.{digits}g}"
    if (v === null || Number.isNaN(v)) return "-";
    if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
    if (v === 0) return "0";
    const [mantissa, exponent] = v.toExponential(digits - 1).split("e");
    const e = Number(exponent);
    const strip = (s) => s.indexOf(".") < 0 ? s : s.replace(/0+$/, "").replace(/\.$/, "");
    if (e < -4 || e >= digits) return strip(mantissa) + "e" + (e < 0 ? "-" : "+") + String(Math.abs(e)).padStart(2, "0");
    return strip(v.toFixed(Math.max(0, digits - 1 - e)));
  }
  function hex(n) { return n.toString(16).padStart(2, "0"); }
  function blend(target, t) {
    t = Math.min(Math.max(t, 0), 1) * view.max_blend;
    return "#" + target.map((c) => hex(Math.round(255 + (c - 255) * t))).join("");
  }
  function colour(v) {  // rlpipe.reports.render.token_color
    const s = view.scale;
    if (Number.isNaN(v)) return "#ffffff";
    if (s.kind === "diverging") return blend(v >= 0 ? view.colours.positive : view.colours.negative, Math.abs(v) / s.hi);
    if (s.kind === "logprob") return blend(view.colours.surprise, v / s.lo);
    return blend(view.colours.magnitude, v / s.hi);
  }

  let tokens = null;  // {offsets, starts, text, ids, values}
  async function load() {
    const blobs = pack.blobs, names = Object.keys(blobs);
    const raw = await Promise.all(names.map((n) => inflate(blobs[n])));
    const got = Object.fromEntries(names.map((n, i) => [n, raw[i]]));
    const lengths = new Uint16Array(unplane(got.lengths, 2));
    const starts = new Uint32Array(lengths.length + 1);
    for (let i = 0; i < lengths.length; i++) starts[i + 1] = starts[i] + lengths[i];
    const values = {};
    for (const c of pack.columns) {
      const bytes = got["column:" + c];
      values[c] = pack.dtype === "q8" ? unlog8(bytes, pack.scales[c])
        : pack.dtype === "f2" ? halves(unplane(bytes, 2)) : new Float32Array(unplane(bytes, 4));
    }
    tokens = {offsets: pack.offsets, starts: starts, text: new TextDecoder().decode(got.text),
              ids: pack.ids ? new Int32Array(unplane(got.ids, 4)) : null, values: values,
              environment: got.environment || null,
              turns: got.turns ? JSON.parse(new TextDecoder().decode(got.turns)) : null};
  }
  function piece(i) { return tokens.text.slice(tokens.starts[i], tokens.starts[i + 1]); }
  function lowRanks(div) {
    const ranks = new Map();
    (div.dataset.low || "").split(",").filter(Boolean).forEach((p, r) => ranks.set(Number(p), r + 1));
    return ranks;
  }
  function tooltip(row, pos, i, rank, env) {
    const id = tokens.ids && tokens.ids[i] >= 0 ? " (id " + tokens.ids[i] + ")" : "";
    const lines = ["token " + pos + ": " + JSON.stringify(piece(i)) + id];
    if (env) lines.push(view.observation.note);
    if (rank) lines.push("least likely token #" + rank + " of this sample");
    for (const c of view.order) if (c in tokens.values) lines.push(c + " = " + g(tokens.values[c][i]));
    return lines.join("\n");
  }

  function turnLines(row) {  // multi-turn: position in the row -> [separator, turn start] (label indices, -1: none)
    const lines = new Map();
    if (tokens.turns) for (const [pos, sep, start] of tokens.turns.marks[row]) lines.set(pos, [sep, start]);
    return lines;
  }
  function line(cls, label) {
    const div = document.createElement("div");
    div.className = cls;
    div.textContent = tokens.turns.labels[label];
    return div;
  }
  function draw(div) {
    const row = Number(div.dataset.row), a = tokens.offsets[row], b = tokens.offsets[row + 1];
    const ranks = lowRanks(div), shade = view.color_by && tokens.values[view.color_by], turns = turnLines(row);
    const frag = document.createDocumentFragment();
    for (let i = a; i < b; i++) {
      const span = document.createElement("span"), text = piece(i), rank = ranks.get(i - a);
      const env = Boolean(tokens.environment && tokens.environment[i]);  // the environment's reply, not the policy's
      const marks = turns.get(i - a);
      if (marks && marks[0] >= 0) frag.appendChild(line("turn-sep", marks[0]));  // the turn, its tool calls
      if (marks && marks[1] >= 0) frag.appendChild(line("turn-start", marks[1]));  // the next model turn
      span.className = env ? "tok obs" : "tok";
      if (env) span.setAttribute("style", "background:" + view.observation.colour);  // whatever the colouring
      else if (shade) span.setAttribute("style", "background:" + colour(shade[i]));
      if (rank) span.setAttribute("data-low", String(rank));
      span.title = tooltip(row, i - a, i, rank, env);
      // a newline is drawn as ⏎ and breaks the line right there, inside the token: a BPE token "\n    "
      // ends one line and indents the next, so code and reasoning keep their structure
      const lines = text.split("\u23ce");
      if (lines[0]) span.append(lines[0]);
      for (let j = 1; j < lines.length; j++) {
        span.append("\u23ce", document.createElement("br"));
        if (lines[j]) span.append(lines[j]);
      }
      frag.appendChild(span);
    }
    div.replaceChildren(frag);
    div.removeAttribute("style");  // the estimated height, until now
    div.dataset.drawn = "1";
    return b - a;
  }
  function esc(s) { return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }
  function table(details) {
    const row = Number(details.dataset.row), a = tokens.offsets[row], b = tokens.offsets[row + 1];
    const cols = view.order.filter((c) => c in tokens.values);
    const out = ["<div class=\"scroll\"><table class=\"per-token\"><tr><th class=\"num\">pos</th><th>token</th>",
                 tokens.ids ? "<th class=\"num\">id</th>" : "", ...cols.map((c) => "<th class=\"num\">" + c + "</th>"), "</tr>"];
    for (let i = a; i < b; i++) {
      out.push("<tr><td class=\"num\">" + (i - a) + "</td><td><code>" + esc(piece(i)) + "</code></td>");
      if (tokens.ids) out.push("<td class=\"num\">" + (tokens.ids[i] >= 0 ? tokens.ids[i] : "-") + "</td>");
      for (const c of cols) out.push("<td class=\"num\">" + g(tokens.values[c][i]) + "</td>");
      out.push("</tr>");
    }
    details.insertAdjacentHTML("beforeend", out.join("") + "</table></div>");
    details.dataset.drawn = "1";
  }

  async function start() {
    const pending = Array.from(document.querySelectorAll("div.completion[data-row]"));
    try {
      await load();
    } catch (err) {
      const why = "this browser could not unpack the page's tokens (" + err + "): open it in a recent " +
                  "Chromium, Firefox or Safari, or browse the rollouts with `rlpipe view`";
      pending.forEach((div) => { div.textContent = why; div.className = "completion warn"; });
      return;
    }
    let drawn = 0;
    while (pending.length && drawn < view.eager_tokens) drawn += draw(pending.shift());
    if (pending.length) {
      const seen = new IntersectionObserver((entries) => {
        for (const e of entries) if (e.isIntersecting) { seen.unobserve(e.target); draw(e.target); }
      }, {rootMargin: "1500px 0px"});
      pending.forEach((div) => seen.observe(div));
    }
    document.addEventListener("toggle", (e) => {
      const d = e.target;
      if (d.matches && d.matches("details.per-token[data-row]") && d.open && !d.dataset.drawn) table(d);
    }, true);
    document.querySelectorAll("details.per-token[data-row][open]").forEach(table);
    document.documentElement.dataset.tokens = "drawn";
    window.rlpipeDrawnAt = performance.now();
  }
  start();
})();
"""
