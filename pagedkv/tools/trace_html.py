"""``pagedkv trace --html FILE``: the index layer of a trace as one self-contained page.

Per step (a slider walks them): the scheduled tokens per request, new requests with their
prefix-cache hits, preemptions and finished ids, then for every KV-cache group its block-table
rows (one cell per logical block: the null block 0 and prefix-cached blocks marked), the
step's slot mapping per row and the FlashInfer-style CSR page index (``indptr``, ``indices``,
``last_page_len``), and the pool's free blocks and usage. ``page.html#step=N`` opens step N. The data is embedded as JSON
(``<script id="trace-data" type="application/json">``) and drawn by a few lines of plain
JavaScript: no network, no external file.
"""

from __future__ import annotations

import html
import json

_STYLE = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} .meta{color:#555;margin-bottom:10px}
.bar{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd}
input[type=range]{width:60%;vertical-align:middle}
table{border-collapse:collapse;margin:4px 0 10px} td,th{border:1px solid #ccc;padding:2px 5px;
text-align:right;font-family:ui-monospace,monospace;font-size:12px}
th{background:#f3f3f3} td.blk.null{background:#eee;color:#999} td.blk.cached{background:#dff3df}
td.rid{text-align:left;font-weight:600} .group{margin:8px 0 14px;padding-left:8px;
border-left:3px solid #8ab} .small{color:#666;font-size:12px} .warn{color:#b00}
code{font-size:12px}
"""

_SCRIPT = r"""
const data = JSON.parse(document.getElementById('trace-data').textContent);
const slider = document.getElementById('step');
slider.max = data.steps.length - 1;
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function list(xs, limit) {
  if (!xs) return '-';
  return xs.length <= limit ? '[' + xs.join(', ') + ']'
    : '[' + xs.slice(0, limit).join(', ') + ', ... ] (' + xs.length + ')';
}
function show(i) {
  const s = data.steps[i];
  document.getElementById('label').textContent =
    'step ' + s.step + ' (' + (i + 1) + ' of ' + data.steps.length + ')';
  const out = document.getElementById('view');
  out.replaceChildren();
  const head = el('div', {class: 'small'});
  head.textContent = 'scheduled ' + s.scheduled.map(x => x[0] + '+' + x[1]).join('  ') +
    ' | free blocks ' + s.free + ' | usage ' + (100 * s.usage).toFixed(1) + '%';
  out.appendChild(head);
  if (s.new.length) out.appendChild(el('div', {}, 'new: ' + s.new.map(
    n => n.id + ' (prefix hit ' + n.hit + ' tokens)').join(', ')));
  if (s.preempted.length) out.appendChild(el('div', {class: 'warn'}, 'preempted: ' + s.preempted.join(', ')));
  if (s.finished.length) out.appendChild(el('div', {}, 'finished: ' + s.finished.join(', ')));
  const cached = new Set(s.cached);
  s.groups.forEach((g, gi) => {
    const box = el('div', {class: 'group'});
    box.appendChild(el('div', {}, 'group ' + gi + ': ' + data.groups[gi]));
    const t = el('table');
    const width = Math.max(1, ...g.table.map(r => r.length));
    const hr = el('tr');
    hr.appendChild(el('th', {}, 'row / request'));
    for (let c = 0; c < width; c++) hr.appendChild(el('th', {}, 'b' + c));
    hr.appendChild(el('th', {}, 'slots this step'));
    t.appendChild(hr);
    g.table.forEach((row, r) => {
      const tr = el('tr');
      tr.appendChild(el('td', {class: 'rid'}, r + ': ' + s.rows[r]));
      for (let c = 0; c < width; c++) {
        const b = row[c];
        const cls = b === undefined ? 'blk' : (b === 0 ? 'blk null' : (cached.has(b) ? 'blk cached' : 'blk'));
        tr.appendChild(el('td', {class: cls}, b === undefined ? '' : String(b)));
      }
      tr.appendChild(el('td', {}, list(g.row_slots[r], 8)));
      t.appendChild(tr);
    });
    box.appendChild(t);
    if (g.indptr) box.appendChild(el('div', {class: 'small'}, 'CSR indptr ' + list(g.indptr, 24) +
      '  indices ' + list(g.indices, 24) + '  last_page_len ' + list(g.last_page_len, 24)));
    out.appendChild(box);
  });
}
slider.addEventListener('input', () => show(Number(slider.value)));
const m = location.hash.match(/step=(\d+)/);  // page.html#step=N opens step N
const start = m ? Math.min(Number(m[1]), data.steps.length - 1) : 0;
slider.value = start;
show(start);
"""


def trace_data(records, summary: dict, groups: list[str], title: str) -> dict:
    """The page's JSON: one entry per step record (``IndexLayerDriver.step``)."""
    steps = []
    for rec in records:
        so = rec.scheduler_output
        # the step's slots, split per batch row (tokens are packed in row order)
        counts = rec.num_scheduled
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        gs = []
        for g, table in enumerate(rec.block_tables):
            gi = rec.groups[g] if rec.groups else None
            slots = gi.slot_mapping if gi is not None else []
            gs.append({
                "table": table,
                "row_slots": [slots[bounds[r]:bounds[r + 1]] for r in range(len(counts))]
                if slots else [[] for _ in table],
                "indptr": None if gi is None else gi.indptr,
                "indices": None if gi is None else gi.indices,
                "last_page_len": None if gi is None else gi.last_page_len,
            })
        steps.append({
            "step": rec.step,
            "scheduled": [[rid, n] for rid, n in so.num_scheduled_tokens.items()],
            "new": [{"id": n.req_id, "hit": n.num_computed_tokens} for n in so.scheduled_new_reqs],
            "preempted": list(rec.preempted),
            "finished": list(rec.finished),
            "rows": list(rec.row_req_ids),
            "groups": gs,
            "cached": list(rec.cached_blocks),
            "free": rec.num_free_blocks,
            "usage": rec.usage,
        })
    return {"title": title, "groups": groups, "summary": summary, "steps": steps}


def trace_page(records, summary: dict, groups: list[str], title: str = "pagedkv trace") -> str:
    """The self-contained HTML page of a trace (see the module docstring)."""
    data = trace_data(records, summary, groups, title)
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    s = summary
    meta = (f"{s['steps']} steps, {s['tokens_generated']} tokens generated, {s['preemptions']} "
            f"preemptions, prefix hit rate {100 * s['prefix_hit_rate']:.1f}% ({s['prefix_hits']} of "
            f"{s['prefix_queries']} prompt tokens), peak usage {100 * s['peak_usage']:.1f}% of "
            f"{s['num_blocks'] - 1} blocks, free at end {s['free_blocks_at_end']}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div class="meta">{html.escape(meta)}<br>groups: {html.escape('; '.join(groups))}.
Block cells: <span style="background:#eee">0 = null block</span>,
<span style="background:#dff3df">prefix-cached block</span>.</div>
<div class="bar"><input type="range" id="step" min="0" value="0"> <span id="label"></span></div>
<div id="view"></div>
<script id="trace-data" type="application/json">{blob}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


__all__ = ["trace_data", "trace_page"]
