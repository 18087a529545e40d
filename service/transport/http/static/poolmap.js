// embcache pool map: polls the daemon's REST API and redraws without reloading.
// No build step and no third-party code: plain DOM and canvas.
"use strict";

(function () {
  const POLL_MS = 1000;
  const TABLE_EVERY = 2; // refresh the entry tables every N polls
  const TOKEN_KEY = "embcache.token";
  const COLORS = {
    free: cssVar("--free"),
    filling: cssVar("--filling"),
    ready: cssVar("--ready"),
    leased: cssVar("--leased"),
    resident: cssVar("--resident"),
    found: cssVar("--found"),
  };

  let token = takeToken();
  let paused = false;
  let inFlight = false;
  let polls = 0;
  let lastMap = null;
  // The searched entry's host page runs ([first, count] pairs), outlined on the host grid.
  let found = null;

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  // A token may come in the URL fragment (#token=...) once; it is kept in localStorage
  // and removed from the address bar so it does not end up in screenshots or history.
  function takeToken() {
    const params = new URLSearchParams(window.location.hash.replace(/^#/, ""));
    const fromHash = params.get("token");
    if (fromHash) {
      try { window.localStorage.setItem(TOKEN_KEY, fromHash); } catch (e) { /* private mode */ }
      history.replaceState(null, "", window.location.pathname + window.location.search);
      return fromHash;
    }
    try { return window.localStorage.getItem(TOKEN_KEY); } catch (e) { return null; }
  }

  class AuthError extends Error {}

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const resp = await fetch(path, { headers, cache: "no-store" });
    if (resp.status === 401) throw new AuthError("unauthorized");
    if (!resp.ok) {
      let detail = resp.statusText;
      try { detail = (await resp.json()).message || detail; } catch (e) { /* not json */ }
      throw new Error(resp.status + " " + detail);
    }
    return resp.json();
  }

  // ---- formatting -------------------------------------------------------------------
  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n);
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }
  function fmtRate(bps) { return fmtBytes(bps) + "/s"; }
  function fmtOps(n) { return n >= 100 ? fmtInt(Math.round(n)) : Number(n).toFixed(1); }
  function fmtLatency(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(2) + " s";
  }
  function fmtPct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
  function fmtInt(n) { return Number(n || 0).toLocaleString("en-US"); }
  function fmtAge(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 60) return seconds.toFixed(0) + " s";
    if (seconds < 3600) return (seconds / 60).toFixed(0) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }
  function setText(id, text) { document.getElementById(id).textContent = text; }

  // ---- canvas helpers ---------------------------------------------------------------
  function sizeCanvas(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(canvas.clientWidth * dpr));
    const h = Math.max(1, Math.round(canvas.clientHeight * dpr));
    if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
    return { ctx: canvas.getContext("2d"), w, h, dpr };
  }

  function drawGrid(canvas, pool) {
    const { ctx, w, h, dpr } = sizeCanvas(canvas);
    ctx.clearRect(0, 0, w, h);
    const n = pool.cells.length;
    if (n === 0) return;
    // Largest square cell (capped, so a small pool is not drawn with huge tiles) for which
    // the grid fits the canvas; shrinking by 3% a step ends within a few hundred steps.
    let cell = Math.min(28 * dpr, Math.sqrt((w * h) / n));
    let cols = 1;
    let rows = n;
    for (;;) {
      cols = Math.max(1, Math.floor(w / cell));
      rows = Math.ceil(n / cols);
      if (rows * cell <= h || cell <= 1) break;
      cell *= 0.97;
    }
    const gap = cell >= 6 * dpr ? Math.max(1, Math.round(dpr)) : 0;
    const offX = (w - cols * cell) / 2;
    layouts[canvas.id.replace("grid-", "")] = { cols, cell, offX, pool };
    for (let i = 0; i < n; i += 1) {
      const name = pool.states[pool.cells.charCodeAt(i) - 48] || "free";
      ctx.fillStyle = COLORS[name] || COLORS.free;
      const x = offX + (i % cols) * cell;
      const y = Math.floor(i / cols) * cell;
      ctx.fillRect(x, y, cell - gap, cell - gap);
    }
    if (canvas.id === "grid-host") outlineFound(ctx, canvas, pool, cols, cell, offX, dpr);
  }

  // Outline every cell that holds a page of the searched entry, so its runs (and the holes
  // between them) stand out; the canvas says how many cells it outlined (data-found-cells).
  function outlineFound(ctx, canvas, pool, cols, cell, offX, dpr) {
    const per = pool.pages_per_cell || 1;
    const cells = new Set();
    for (const [first, count] of found || []) {
      const last = Math.min(first + count, pool.num_pages) - 1;
      for (let c = Math.floor(first / per); c <= Math.floor(last / per); c += 1) cells.add(c);
    }
    canvas.dataset.foundCells = String(cells.size);
    if (!cells.size) return;
    const width = Math.max(1, Math.min(3 * dpr, Math.floor(cell / 3)));
    ctx.fillStyle = COLORS.found;
    for (const i of cells) {
      const x = offX + (i % cols) * cell;
      const y = Math.floor(i / cols) * cell;
      if (cell <= 3 * width) { ctx.fillRect(x, y, cell, cell); continue; }
      ctx.fillRect(x, y, cell, width);
      ctx.fillRect(x, y + cell - width, cell, width);
      ctx.fillRect(x, y, width, cell);
      ctx.fillRect(x + cell - width, y, width, cell);
    }
  }

  // Remember each grid's geometry so a hover can name the pages under the pointer.
  const layouts = {};

  function describeCell(kind, ev) {
    const lay = layouts[kind];
    if (!lay) return "";
    const canvas = ev.target;
    const dpr = window.devicePixelRatio || 1;
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor(((ev.clientX - rect.left) * dpr - lay.offX) / lay.cell);
    const row = Math.floor(((ev.clientY - rect.top) * dpr) / lay.cell);
    const i = row * lay.cols + col;
    if (col < 0 || col >= lay.cols || i < 0 || i >= lay.pool.cells.length) return "";
    const per = lay.pool.pages_per_cell;
    const first = i * per;
    const last = Math.min(first + per, lay.pool.num_pages) - 1;
    const state = lay.pool.states[lay.pool.cells.charCodeAt(i) - 48];
    const pages = first === last ? `page ${first}` : `pages ${first}–${last}`;
    return `${pages}: ${per > 1 ? "mostly " : ""}${state}`;
  }

  function drawSpark(canvas, values, color, maxHint) {
    const { ctx, w, h, dpr } = sizeCanvas(canvas);
    ctx.clearRect(0, 0, w, h);
    const pts = values.map((v, i) => [i, v]).filter((p) => p[1] !== null && p[1] !== undefined);
    ctx.strokeStyle = cssVar("--line");
    ctx.lineWidth = dpr;
    ctx.beginPath();
    ctx.moveTo(0, h - dpr / 2);
    ctx.lineTo(w, h - dpr / 2);
    ctx.stroke();
    if (pts.length < 2) return;
    const maxV = Math.max(maxHint || 0, ...pts.map((p) => p[1])) || 1;
    const x = (i) => (values.length <= 1 ? w : (i / (values.length - 1)) * (w - 2 * dpr) + dpr);
    const y = (v) => h - 2 * dpr - (v / maxV) * (h - 4 * dpr);
    ctx.beginPath();
    pts.forEach((p, k) => (k === 0 ? ctx.moveTo(x(p[0]), y(p[1])) : ctx.lineTo(x(p[0]), y(p[1]))));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5 * dpr;
    ctx.stroke();
    ctx.lineTo(x(pts[pts.length - 1][0]), h);
    ctx.lineTo(x(pts[0][0]), h);
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }

  function drawLegend(id, pool) {
    const ul = document.getElementById(id);
    ul.replaceChildren();
    const total = pool.num_pages || 1;
    for (const name of pool.states) {
      const li = document.createElement("li");
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = COLORS[name] || COLORS.free;
      const count = pool.counts[name] || 0;
      li.append(sw, `${name} ${fmtInt(count)} (${((100 * count) / total).toFixed(1)}%)`);
      ul.append(li);
    }
  }

  // ---- rendering --------------------------------------------------------------------
  function renderPool(kind, pool) {
    const section = document.getElementById(kind + "-pool");
    if (!pool) { section.hidden = true; return; }
    section.hidden = false;
    const per = pool.pages_per_cell > 1 ? ` · ${fmtInt(pool.pages_per_cell)} pages per cell` : "";
    setText(kind + "-geom",
      `${fmtInt(pool.num_pages)} pages of ${fmtBytes(pool.page_bytes)}${per}`);
    drawGrid(document.getElementById("grid-" + kind), pool);
    drawLegend("legend-" + kind, pool);
    if (kind === "host" && found && found.length) {
      const li = document.createElement("li");
      const sw = document.createElement("span");
      sw.className = "swatch swatch-found";
      li.append(sw, "searched key");
      document.getElementById("legend-host").append(li);
    }
  }

  function renderCards(map) {
    const s = map.summary;
    const hostFrac = s.host_capacity_bytes ? s.host_used_bytes / s.host_capacity_bytes : 0;
    setText("host-used", fmtBytes(s.host_used_bytes));
    setText("host-cap", `of ${fmtBytes(s.host_capacity_bytes)} · ${fmtPct(hostFrac)} used`);
    document.getElementById("host-meter").style.width = (100 * hostFrac).toFixed(1) + "%";
    const dev = document.getElementById("device-card");
    if (s.device_capacity_bytes) {
      dev.hidden = false;
      const f = s.device_used_bytes / s.device_capacity_bytes;
      setText("device-used", fmtBytes(s.device_used_bytes));
      setText("device-cap", `of ${fmtBytes(s.device_capacity_bytes)} · ${fmtPct(f)} used`);
      document.getElementById("device-meter").style.width = (100 * f).toFixed(1) + "%";
    } else {
      dev.hidden = true;
    }
    setText("entries", fmtInt(s.entries));
    const warm = s.adopted_entries || s.dropped_checksum_entries || s.dropped_layout_entries
      ? ` · restart: ${fmtInt(s.adopted_entries)} adopted, ${fmtInt(s.dropped_checksum_entries)}`
        + ` dropped by checksum, ${fmtInt(s.dropped_layout_entries)} by layout`
      : "";
    setText("entries-foot",
      `${fmtInt(s.filling)} filling · ${fmtInt(s.evictions)} evicted${warm}`);
    setText("leases", fmtInt(s.leases_active));
    const pinned = (map.host.counts.leased || 0) * map.host.page_bytes;
    setText("evictions", `pin ${fmtBytes(pinned)} of host pages`);

    const hist = map.history;
    // Two figures, each with its own label: the last sampling interval (null when nothing
    // was read in it: shown as such, never replaced by the lifetime figure) and lifetime.
    const last = hist.hit_rate.length ? hist.hit_rate[hist.hit_rate.length - 1] : null;
    const lifetime = s.hits + s.misses > 0 ? s.hits / (s.hits + s.misses) : null;
    const interval = `last ${hist.interval_s.toFixed(0)} s`;
    setText("hit-rate", last === null ? "–" : fmtPct(last));
    setText("hit-rate-label", last === null ? `${interval}: no lookups` : interval);
    setText("hit-foot", `${fmtPct(lifetime)} of ${fmtInt(s.hits + s.misses)} lookups`);
    setText("build", `embcache ${map.version} · commit ${map.commit}`);
    drawSpark(document.getElementById("spark-hit"), hist.hit_rate, COLORS.ready, 1);

    // Host bytes and operations: what clients moved through the daemon, device or not.
    const lastOf = (xs) => (xs && xs.length ? xs[xs.length - 1] : null);
    const io = hist.t.map((_, i) => (hist.host_in[i] || 0) + (hist.host_out[i] || 0));
    setText("host-io", fmtRate(lastOf(io) || 0));
    setText("host-io-label", `in + out · ${interval}`);
    setText("host-io-foot",
      `in ${fmtRate(lastOf(hist.host_in) || 0)} · out ${fmtRate(lastOf(hist.host_out) || 0)}`);
    drawSpark(document.getElementById("spark-io"), io, COLORS.filling, 0);
    const ops = lastOf(hist.ops);
    setText("ops", ops === null ? "–" : fmtOps(ops));
    setText("ops-label", `per s · ${interval}`);
    const p50 = lastOf(hist.p50_s);
    const p99 = lastOf(hist.p99_s);
    setText("ops-foot", p50 === null || p50 === undefined ? "no operations"
      : `p50 ${fmtLatency(p50)} · p99 ${fmtLatency(p99)}`);
    drawSpark(document.getElementById("spark-ops"), hist.ops, COLORS.leased, 0);

    const dirs = Object.keys(hist.bandwidth);
    const total = hist.t.map((_, i) => dirs.reduce((acc, d) => acc + (hist.bandwidth[d][i] || 0), 0));
    setText("bandwidth", fmtRate(total.length ? total[total.length - 1] : 0));
    const peak = total.length ? Math.max(...total) : 0;
    // Name only the directions that moved bytes in the window, busiest first.
    const busy = dirs
      .map((d) => [d, Math.max(0, ...hist.bandwidth[d])])
      .filter((x) => x[1] > 0)
      .sort((a, b) => b[1] - a[1])
      .map((x) => x[0]);
    const foot = busy.length ? `${busy.join(" · ")} · peak ${fmtRate(peak)}`
      : "no device copies";
    setText("bw-foot", foot);
    drawSpark(document.getElementById("spark-bw"), total, COLORS.resident, 0);
  }

  function renderHealth(map) {
    const pill = document.getElementById("health");
    if (map.draining) { pill.className = "pill pill-warn"; pill.textContent = "draining"; }
    else if (map.ready) { pill.className = "pill pill-ok"; pill.textContent = "ready"; }
    else { pill.className = "pill pill-warn"; pill.textContent = "starting"; }
    setText("updated", "updated " + new Date(map.time * 1000).toLocaleTimeString());
  }

  function stateCell(state) {
    const td = document.createElement("td");
    const span = document.createElement("span");
    span.className = "state";
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = COLORS[state] || COLORS.free;
    span.append(sw, state);
    td.append(span);
    return td;
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function renderTable(id, items, last) {
    const tbody = document.querySelector(`#${id} tbody`);
    const rows = items.map((e) => {
      const tr = document.createElement("tr");
      const key = cell("", "key");
      const label = document.createElement("span");
      label.textContent = e.key;
      label.title = e.key;
      key.append(label);
      const onDevice = e.residency.some((r) => r !== "host");
      const state = e.leases > 0 ? "leased" : onDevice ? "resident" : e.state;
      const lastCol = last === "idle" ? cell(fmtAge(e.idle_s), "num") : cell(fmtInt(e.leases), "num");
      tr.append(key, cell(e.dtype), cell("[" + e.shape.join(", ") + "]"),
        cell(fmtBytes(e.nbytes), "num"), stateCell(state), lastCol);
      return tr;
    });
    if (rows.length === 0) {
      const tr = document.createElement("tr");
      const td = cell("no entries yet", "empty");
      td.colSpan = 6;
      tr.append(td);
      rows.push(tr);
    }
    tbody.replaceChildren(...rows);
  }

  // ---- polling ----------------------------------------------------------------------
  function showError(message) {
    const el = document.getElementById("error");
    el.hidden = !message;
    el.textContent = message || "";
  }

  async function tick() {
    if (paused || inFlight) return;
    inFlight = true;
    try {
      const map = await api("v1/pool-map");
      lastMap = map;
      renderHealth(map);
      renderCards(map);
      renderPool("host", map.host);
      renderPool("device", map.device);
      if (polls % TABLE_EVERY === 0) {
        const [big, recent] = await Promise.all([
          api("v1/entries?sort=size&limit=8"),
          api("v1/entries?sort=recent&limit=8"),
        ]);
        renderTable("table-size", big.items, "leases");
        renderTable("table-recent", recent.items, "idle");
      }
      polls += 1;
      document.getElementById("auth").hidden = true;
      showError(null);
    } catch (err) {
      if (err instanceof AuthError) {
        document.getElementById("auth").hidden = false;
        showError(null);
      } else {
        showError("Cannot reach the daemon: " + err.message);
      }
      const pill = document.getElementById("health");
      pill.className = "pill pill-bad";
      pill.textContent = err instanceof AuthError ? "token needed" : "unreachable";
    } finally {
      inFlight = false;
    }
  }

  document.getElementById("auth-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = document.getElementById("auth-token").value.trim() || null;
    try {
      if (token) window.localStorage.setItem(TOKEN_KEY, token);
    } catch (e) { /* private mode */ }
    polls = 0;
    tick();
  });

  // Look up one key: its detail from the API, in words (absent keys say so).
  document.getElementById("search").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = document.getElementById("search-key").value;
    const out = document.getElementById("search-result");
    out.hidden = false;
    found = null;
    if (!key) { out.textContent = "Type a key to look it up."; redrawHost(); return; }
    const path = "v1/entries/" + key.split("/").map(encodeURIComponent).join("/");
    try {
      const e = await api(path);
      const where = e.residency.join(", ");
      const leases = e.leases ? `${fmtInt(e.leases)} leases` : "no leases";
      out.textContent = `${e.key}: ${e.state}, ${e.dtype} [${e.shape.join(", ")}], ` +
        `${fmtBytes(e.nbytes)} in ${fmtInt(e.num_runs)} page runs, on ${where}, ${leases}, ` +
        `idle ${fmtAge(e.idle_s)}`;
      out.dataset.found = "1";
      found = e.page_runs.map((r) => [r.first_page, r.num_pages]);
      if (found.length) out.textContent += " · its pages are outlined on the host grid";
      document.getElementById("search-clear").hidden = false;
    } catch (err) {
      out.dataset.found = "0";
      out.textContent = String(err.message).startsWith("404") ? `No entry ${key}.`
        : "Lookup failed: " + err.message;
    }
    redrawHost();
  });

  function redrawHost() {
    if (lastMap) renderPool("host", lastMap.host);
  }

  document.getElementById("search-clear").addEventListener("click", (ev) => {
    found = null;
    ev.target.hidden = true;
    document.getElementById("search-result").hidden = true;
    redrawHost();
  });

  document.getElementById("pause").addEventListener("click", (ev) => {
    paused = !paused;
    ev.target.textContent = paused ? "Resume" : "Pause";
    ev.target.setAttribute("aria-pressed", String(paused));
    if (!paused) tick();
  });

  // A token pasted into the fragment of an open page (#token=...) takes effect at once.
  window.addEventListener("hashchange", () => {
    const fresh = takeToken();
    if (fresh) { token = fresh; polls = 0; tick(); }
  });

  for (const kind of ["host", "device"]) {
    const canvas = document.getElementById("grid-" + kind);
    canvas.addEventListener("mousemove", (ev) => { canvas.title = describeCell(kind, ev); });
  }

  window.addEventListener("resize", () => {
    if (!lastMap) return;
    renderPool("host", lastMap.host);
    renderPool("device", lastMap.device);
    renderCards(lastMap);
  });

  tick();
  window.setInterval(tick, POLL_MS);
})();
