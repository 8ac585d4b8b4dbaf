// llmtap live view: reads /events (server-sent events from the admin listener) and draws what it says.
// No framework and no build step; every text that came from a client (route, model) goes in via textContent.
"use strict";

(() => {
  const WINDOWS = ["1m", "5m", "15m", "all"];
  const WINDOW_NAMES = { "1m": "last minute", "5m": "last 5 minutes", "15m": "last 15 minutes", all: "since start" };
  const MAX_ROWS = 200;
  const SVG = "http://www.w3.org/2000/svg";

  const state = {
    window: initialWindow(),
    last: 0,
    requests: [], // oldest first
    rows: new Map(), // id -> row element
    scale: "shared",
    span: 0, // ms the shared scale covers
    selected: null,
    traces: false,
    source: null,
    statusTimer: 0,
  };

  const $ = (id) => document.getElementById(id);

  function initialWindow() {
    const w = new URLSearchParams(location.search).get("window");
    return WINDOWS.includes(w) ? w : "5m";
  }

  // -- formatting ------------------------------------------------------------------------------

  function dur(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const ms = seconds * 1000;
    if (ms < 10) return ms.toFixed(2) + " ms";
    if (ms < 100) return ms.toFixed(1) + " ms";
    if (ms < 1000) return ms.toFixed(0) + " ms";
    if (seconds < 10) return seconds.toFixed(2) + " s";
    return seconds.toFixed(1) + " s";
  }

  function rate(x) {
    if (x === null || x === undefined) return "–";
    if (x < 10) return x.toFixed(2);
    if (x < 100) return x.toFixed(1);
    return Math.round(x).toLocaleString("en-US");
  }

  const int = (n) => (n === null || n === undefined ? "–" : n.toLocaleString("en-US"));
  const pct = (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(1) + "%");

  function span(seconds) {
    if (seconds < 9.95) return seconds.toFixed(1) + " s";
    const s = Math.round(seconds);
    if (s < 60) return s + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${s % 60} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function clock(ms) {
    return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }

  // -- connection ------------------------------------------------------------------------------

  function setStatus(kind) {
    clearTimeout(state.statusTimer);
    const apply = () => {
      $("status").dataset.state = kind;
      $("status-text").textContent = kind;
    };
    // A stream ends every few seconds by design and the browser reconnects at once: only a lasting
    // failure is worth showing.
    if (kind === "reconnecting") state.statusTimer = setTimeout(apply, 2500);
    else apply();
  }

  function hello(h) {
    state.traces = h.traces;
  }

  function connect() {
    if (state.source) state.source.close();
    const es = new EventSource(`events?window=${encodeURIComponent(state.window)}&after=${state.last}`);
    state.source = es;
    es.addEventListener("hello", (e) => {
      hello(JSON.parse(e.data));
      setStatus("live");
    });
    es.addEventListener("requests", (e) => addRequests(JSON.parse(e.data)));
    es.addEventListener("snapshot", (e) => renderSnapshot(JSON.parse(e.data)));
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) {
        setStatus("offline");
        setTimeout(() => state.source === es && connect(), 3000);
      } else {
        setStatus("reconnecting");
      }
    };
  }

  function markWindow(w) {
    state.window = w;
    for (const b of document.querySelectorAll("#windows button")) b.classList.toggle("on", b.dataset.window === w);
  }

  function chooseWindow(w) {
    markWindow(w);
    history.replaceState(null, "", `?window=${w}`);
    connect();
  }

  // The page arrives with the figures a stream would send first: drawn at once, so the page shows numbers
  // on load (a screenshot taken then too), before any stream is open.
  function drawInitial() {
    const node = $("initial");
    let first = null;
    try {
      first = JSON.parse(node.textContent);
    } catch {
      return; // served without its data: the stream brings everything
    }
    if (!first || !first.snapshot) return;
    hello(first.hello);
    if (first.hello.window === state.window) {
      addRequests(first.requests);
      renderSnapshot(first.snapshot);
    }
  }

  // -- figures per route and model ---------------------------------------------------------------

  function tile(fig, label) {
    const t = el("div", "tile");
    t.append(el("span", "label", label));
    const v = el("span", "value", "–");
    v.dataset.fig = fig;
    t.append(v, el("small", null, " "));
    return t;
  }

  const LATENCIES = [
    ["ttft", "TTFT", "first token"],
    ["itl", "ITL", "per token"],
    ["tpot", "TPOT", "per output token"],
    ["ttfot", "TTFOT", "first answer token"],
    ["ttst", "TTST", "second token"],
  ];

  function card(route, model, shape, version) {
    const c = el("article", "card");
    c.dataset.route = route;
    c.dataset.model = model;
    c.dataset.shape = shape;
    if (version) c.dataset.version = version;
    const head = el("div", "card-head");
    const count = el("span", "count");
    const n = el("b", null, "0");
    n.dataset.fig = "requests";
    count.append(n, " requests");
    head.append(el("span", "route", route), el("span", "shape", shape));
    // Each prompt version is a card of its own: the split a prompt change is judged by.
    if (version) head.append(el("span", "version", version));
    head.append(el("span", "model", model || "(no model)"), count);
    const tiles = el("div", "tiles");
    tiles.append(
      tile("requests_per_s", "requests/s"),
      tile("output_tokens_per_s", "output tok/s"),
      tile("goodput_per_s", "goodput/s"),
      tile("cached_share", "cached input"),
      tile("errors", "errors"),
    );
    const table = el("table", "lat");
    const thead = el("thead");
    const hr = el("tr");
    for (const h of ["", "p50", "p95", "p99", "samples"]) hr.append(el("th", null, h));
    thead.append(hr);
    const tbody = el("tbody");
    for (const [key, name, what] of LATENCIES) {
      const tr = el("tr");
      tr.dataset.metric = key;
      const th = el("th", null, name);
      th.append(el("small", null, what));
      tr.append(th);
      for (const q of ["p50", "p95", "p99"]) {
        const td = el("td", null, "–");
        td.dataset.fig = `${key}.${q}`;
        // A percentile opens the slowest request behind it and marks the others in the waterfall list.
        td.addEventListener("click", () => showTail(c, key, q));
        tr.append(td);
      }
      const n2 = el("td", "n", "0");
      n2.dataset.fig = `${key}.count`;
      tr.append(n2);
      tbody.append(tr);
    }
    table.append(thead, tbody);
    const goal = el("div", "slo-line");
    goal.dataset.fig = "verdict";
    c.append(head, tiles, goal, table);
    return c;
  }

  const FIGURE_NAMES = { ttft: "TTFT", tpot: "TPOT", e2e: "E2E", ttfot: "TTFOT", ttst: "TTST" };

  function verdictText(v) {
    if (!v) return "";
    return v.checks
      .map((k) => `p${+(k.percentile * 100).toFixed(2)} ${FIGURE_NAMES[k.figure]} ≤ ${dur(k.limit)}: ${approx(k.value, k.exact)} ${k.verdict}${shortOf(k)}`)
      .join(" · ");
  }

  // The requests' own objectives (x-slo-ttft-ms, x-slo-tpot-ms headers): how many got what they asked.
  function askedText(asked) {
    if (!asked) return "";
    return Object.entries(asked)
      .map(([figure, n]) => {
        const all = (n.met || 0) + (n.violated || 0);
        return `own ${FIGURE_NAMES[figure]} objective met by ${n.met || 0} of ${all} requests`;
      })
      .join(" · ");
  }

  // Why a verdict waits, as `llmtap slo` says it: the requests with the figure against those the percentile needs.
  function shortOf(k) {
    return k.verdict === "insufficient" && k.needed ? ` (${k.count} of ${k.needed} requests)` : "";
  }

  // A percentile over every value in the window is exact; past the values kept it is read from buckets,
  // held within the smallest and largest value, and marked so.
  function approx(value, exact) {
    return exact || value === null || value === undefined ? dur(value) : `≈${dur(value)}`;
  }

  function showTail(c, key, q) {
    const ids = (c.slowest && c.slowest[key] && c.slowest[key][q]) || [];
    for (const [id, node] of state.rows) node.classList.toggle("behind", ids.includes(id));
    if (ids.length) select(ids[0]);
  }

  function setFig(c, fig, text, note) {
    const node = c.querySelector(`[data-fig="${fig}"]`);
    node.textContent = text;
    if (note !== undefined) node.nextElementSibling.textContent = note;
    return node;
  }

  function fillCard(c, s, snap) {
    const slo = snap.slo;
    // Rates divide by the window's seconds, or by the seconds this series had requests in flight ("busy").
    const over = snap.rates === "busy" ? `${span(s.rate_seconds)} busy` : span(snap.seconds);
    setFig(c, "requests", int(s.requests));
    setFig(c, "requests_per_s", rate(s.requests_per_s), `${int(s.requests)} in ${over}`);
    setFig(c, "output_tokens_per_s", rate(s.output_tokens_per_s), `${int(s.output_tokens)} tok`);
    if (slo) {
      const share = s.requests ? s.slo_met / s.requests : 0;
      setFig(c, "goodput_per_s", rate(s.goodput_per_s), `${int(s.slo_met)} met (${pct(share)})`);
    } else {
      setFig(c, "goodput_per_s", "–", "no SLO configured");
    }
    setFig(c, "cached_share", pct(s.cached_share), `${int(s.cache_read_tokens)} / ${int(s.input_tokens)} tok`);
    const errors = setFig(c, "errors", int(s.errors), `${int(s.cancelled)} cancelled`);
    errors.classList.toggle("bad", s.errors > 0);
    for (const [key] of LATENCIES) {
      for (const q of ["p50", "p95", "p99"]) {
        const node = setFig(c, `${key}.${q}`, approx(s[key][q], s[key].exact));
        node.classList.toggle("approx", !s[key].exact);
        const ids = (s.slowest && s.slowest[key] && s.slowest[key][q]) || [];
        node.classList.toggle("link", ids.length > 0);
        const how = s[key].exact ? "exact over the window" : "read from buckets (older values not kept)";
        node.title = ids.length ? `${how}; the ${ids.length} slowest kept requests at or past ${q}: click for their waterfalls` : how;
      }
      setFig(c, `${key}.count`, int(s[key].count));
    }
    c.slowest = s.slowest;
    const goal = c.querySelector('[data-fig="verdict"]');
    goal.textContent = [verdictText(s.verdict), askedText(s.request_objectives)].filter((t) => t).join(" · ");
    goal.dataset.verdict = s.verdict ? s.verdict.verdict : "none";
  }

  function renderSnapshot(snap) {
    const box = $("series");
    const seen = new Set();
    for (const s of snap.series) {
      const key = JSON.stringify([s.route, s.model, s.shape, s.prompt_version]);
      seen.add(key);
      let c = [...box.children].find((x) => x.dataset.key === key);
      if (!c) {
        c = card(s.route, s.model, s.shape, s.prompt_version);
        c.dataset.key = key;
        box.append(c);
      }
      fillCard(c, s, snap);
    }
    for (const c of [...box.children]) if (!seen.has(c.dataset.key)) c.remove();
    box.dataset.last = snap.last;
    box.dataset.seconds = snap.seconds;
    box.dataset.window = state.window;
    $("series-empty").hidden = snap.series.length > 0;
    const covered = snap.window === null || snap.seconds < snap.window - 0.5 ? ` (${span(snap.seconds)} covered)` : "";
    $("window-meta").textContent = `${WINDOW_NAMES[state.window]}${covered} · updated ${clock(Date.now())}`;
  }

  // -- waterfalls ------------------------------------------------------------------------------

  function niceSpan(ms) {
    const steps = [1, 2, 2.5, 5, 10];
    let base = 10 ** Math.floor(Math.log10(Math.max(ms, 1)));
    for (;;) {
      for (const s of steps) if (s * base >= ms) return s * base;
      base *= 10;
    }
  }

  function drawAxis() {
    const axis = $("axis");
    axis.replaceChildren();
    for (let i = 0; i <= 4; i++) {
      const label = state.scale === "each" ? `${i * 25}%` : i === 0 ? "0" : dur((state.span * i) / 4000);
      const s = el("span", null, label);
      s.style.left = `${i * 25}%`;
      axis.append(s);
    }
  }

  function drawBar(bar, r) {
    const total = state.scale === "each" ? Math.max(r.e2e || 0, 0.001) : state.span;
    const x = (ms) => Math.min((ms / total) * 1000, 1000);
    bar.replaceChildren();
    bar.append(svg("rect", { class: "tail", x: 0, y: 8, width: x(r.e2e || 0), height: 2 }));
    for (const p of r.phases) {
      const rect = svg("rect", {
        class: `ph ph-${p.phase} src-${p.class}`,
        x: x(p.start).toFixed(2),
        y: 2,
        width: Math.max(x(p.length), 1.5).toFixed(2),
        height: 14,
      });
      const title = svg("title", {});
      title.textContent = `${p.phase} ${dur(p.length / 1000)} (${p.source})`;
      rect.append(title);
      bar.append(rect);
    }
    if (r.ticks.length) {
      const d = r.ticks.map((t) => `M${x(t).toFixed(1)} 3V15`).join("");
      bar.append(svg("path", { class: "ticks", d, "vector-effect": "non-scaling-stroke" }));
    }
  }

  function badge(text, cls) {
    return el("span", `badge ${cls || ""}`, text);
  }

  function row(r) {
    const node = el("div", "req");
    node.dataset.id = r.id;
    if (r.response_id) node.dataset.responseId = r.response_id;
    node.tabIndex = 0;
    const rm = el("span", "rm", r.route + " · ");
    rm.append(el("em", null, r.model || "(no model)"));
    const tok = el("span", "tok");
    tok.append(el("b", null, int(r.input_tokens)));
    if (r.cache_read_tokens) tok.append(` (${int(r.cache_read_tokens)} cached)`);
    tok.append(" → ");
    tok.append(el("b", null, int(r.output_tokens)));
    const badges = el("span", "badges");
    if (r.cache_class) badges.append(badge(r.cache_class, "cache"));
    // A failed request misses every SLO by definition: its error says more than "SLO missed".
    if (r.outcome !== "ok") badges.append(badge(r.error_type || r.outcome, "err"));
    else if (r.slo !== "none") badges.append(badge(r.slo === "met" ? "SLO met" : "SLO missed", r.slo));
    const bar = svg("svg", { class: "bar", viewBox: "0 0 1000 18", preserveAspectRatio: "none" });
    node.append(el("time", null, clock(r.at)), rm, tok, badges, bar, el("span", "e2e", dur(r.e2e / 1000)));
    drawBar(bar, r);
    node.addEventListener("click", () => select(r.id));
    node.addEventListener("keydown", (e) => e.key === "Enter" && select(r.id));
    return node;
  }

  function addRequests(batch) {
    const fresh = batch.filter((r) => r.id > state.last);
    if (!fresh.length) return;
    state.last = fresh[fresh.length - 1].id;
    state.requests.push(...fresh);
    const list = $("requests");
    while (state.requests.length > MAX_ROWS) {
      const old = state.requests.shift();
      state.rows.get(old.id)?.remove();
      state.rows.delete(old.id);
    }
    const span = niceSpan(Math.max(...state.requests.map((r) => r.e2e || 0)));
    const rescale = span !== state.span;
    state.span = span;
    for (const r of fresh) {
      const node = row(r);
      if (state.requests.length > fresh.length) node.classList.add("fresh");
      state.rows.set(r.id, node);
      list.prepend(node);
    }
    if (rescale) redraw();
    $("requests-empty").hidden = true;
  }

  function redraw() {
    drawAxis();
    for (const r of state.requests) {
      const node = state.rows.get(r.id);
      if (node) drawBar(node.querySelector("svg.bar"), r);
    }
  }

  // -- details ---------------------------------------------------------------------------------

  function select(id) {
    const r = state.requests.find((x) => x.id === id);
    if (!r) return;
    state.selected = id;
    for (const [k, node] of state.rows) node.classList.toggle("sel", k === id);
    $("details-title").textContent = `Request ${clock(r.at)}`;
    const dl = $("details-body");
    dl.replaceChildren();
    const put = (name, value, note, mono) => {
      dl.append(el("dt", null, name));
      const dd = el("dd", mono ? "mono" : null, value === null || value === undefined || value === "" ? "–" : value);
      if (note) dd.append(el("span", "src", ` ${note}`));
      dl.append(dd);
    };
    const phase = (name) => r.phases.find((p) => p.phase === name);
    put("route", r.route);
    put("model", r.model);
    put("response model", r.response_model);
    put("operation", r.operation);
    put("provider", r.provider);
    put("path", r.path, null, true);
    put("status", r.status === null ? null : String(r.status));
    put("outcome", r.error_type ? `${r.outcome} (${r.error_type})` : r.outcome);
    put("SLO", r.slo);
    put("TTFT", r.ttft === null ? null : dur(r.ttft / 1000));
    put("TTFB", r.ttfb === null ? null : dur(r.ttfb / 1000));
    put("TPOT", r.tpot === null ? null : dur(r.tpot / 1000));
    put("TTFOT", r.ttfot === null || r.ttfot === undefined ? null : dur(r.ttfot / 1000));
    put("TTST", r.ttst === null || r.ttst === undefined ? null : dur(r.ttst / 1000));
    put("total", r.e2e === null ? null : dur(r.e2e / 1000));
    for (const name of ["queue", "prefill", "decode"]) {
      const p = phase(name);
      put(name, p ? dur(p.length / 1000) : null, p ? p.source : null);
    }
    // The upstream time the server's own queue and prefill leave out: shown as itself, in neither.
    if (r.upstream_unattributed !== null && r.upstream_unattributed !== undefined) {
      put("unattributed", dur(r.upstream_unattributed / 1000), "upstream TTFT − server queue − server prefill");
    }
    put("chunks", int(r.chunks), r.ticks.length < r.chunks ? `(${int(r.ticks.length)} drawn)` : null);
    put("input tokens", int(r.input_tokens), r.input_source);
    put("cache read", int(r.cache_read_tokens));
    put("cache write", int(r.cache_write_tokens));
    put("output tokens", int(r.output_tokens), r.output_source);
    put("input size", r.input_size);
    put("shape", r.shape);
    put("cache class", r.cache_class);
    put("prompt version", r.prompt_version);
    put("tenant", r.tenant);
    put("user", r.user);
    put("cost", r.cost === null || r.cost === undefined ? null : `$${Number(r.cost).toPrecision(4)}`,
      r.cost === null || r.cost === undefined ? r.cost_status : null);
    put("response id", r.response_id, null, true);
    if (state.traces) put("trace id", r.trace_id, null, true);
    else put("trace id", "no tracing backend configured");
    $("details").hidden = false;
    $("details").dataset.id = id;
    document.querySelector(".wf").classList.add("open");
  }

  function closeDetails() {
    state.selected = null;
    $("details").hidden = true;
    document.querySelector(".wf").classList.remove("open");
    for (const node of state.rows.values()) node.classList.remove("sel");
  }

  // -- start -----------------------------------------------------------------------------------

  for (const b of document.querySelectorAll("#windows button")) b.addEventListener("click", () => chooseWindow(b.dataset.window));
  for (const b of document.querySelectorAll("#scale button")) {
    b.addEventListener("click", () => {
      state.scale = b.dataset.scale;
      for (const x of document.querySelectorAll("#scale button")) x.classList.toggle("on", x === b);
      redraw();
    });
  }
  $("details-close").addEventListener("click", closeDetails);
  drawAxis();
  markWindow(state.window);
  drawInitial();
  // The stream opens once the page has loaded: nothing waiting for the load (a screenshot) waits on it.
  if (document.readyState === "complete") connect();
  else window.addEventListener("load", () => setTimeout(connect, 0), { once: true });
})();
