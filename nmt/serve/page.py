"""The page at `/` to try the model: no external assets, so it works offline. A server of several pairs
offers them in a list; the first is chosen at first."""

from __future__ import annotations

import html
import json

from nmt.serve.pairs import language_name

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nmt: __PAIR__</title>
<style>
body { font: 16px/1.4 system-ui, sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em; color: #222; }
.panes { display: flex; gap: 1em; flex-wrap: wrap; }
.pane { flex: 1 1 20em; display: flex; flex-direction: column; }
textarea, output { font: inherit; min-height: 10em; padding: .5em; border: 1px solid #999; }
output { white-space: pre-wrap; background: #f6f6f6; display: block; }
button { font: inherit; margin: .5em .3em .5em 0; padding: .3em 1.2em; }
.bar { display: flex; justify-content: space-between; align-items: center; color: #666; font-size: 90%; }
#status { color: #666; min-height: 1.4em; }
#status.error { color: #b00; }
#alternatives { list-style: none; padding: 0; margin: .3em 0; }
#alternatives li { cursor: pointer; padding: .2em .4em; border-left: 3px solid #ccc; margin: .2em 0; }
#alternatives li:hover { background: #eef; }
pre { background: #f6f6f6; padding: .5em; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; color: #555; font-size: 90%; }
dd { margin: 0; }
</style></head>
<body>
<h1 id="title">Translate __PAIRNAMES__</h1>
<p __ONEPAIR__><label>Pair: <select id="pair">__OPTIONS__</select></label></p>
<div class="panes">
<label class="pane"><span id="srcname">__SRC__</span>
<textarea id="source" maxlength="__MAX__" autofocus placeholder="Type text to translate"></textarea>
<span class="bar"><span id="count">0 / __MAX__</span>
<button id="clear" type="button">Clear</button></span></label>
<div class="pane"><span id="tgtname">__TGT__</span>
<output id="result" for="source" aria-live="polite"></output>
<span class="bar"><span></span><button id="copy" type="button">Copy</button></span>
<ul id="alternatives" aria-label="alternatives"></ul></div>
</div>
<button id="go" type="button">Translate</button> <span id="status"></span>
<p><label>Translate a .txt file: <input id="file" type="file" accept=".txt,text/plain"></label>
<a id="download" hidden>Download the translation</a></p>
<details id="api"><summary>Use the API</summary>
<pre id="curl"></pre></details>
<dl>__SETTINGS__</dl>
<script>
const $ = (id) => document.getElementById(id);
const source = $("source"), result = $("result"), status = $("status"), alts = $("alternatives");
const limit = __MAX__, wanted = __ALTS__;
const pairs = __PAIRS__;  // [source code, target code, source name, target name]
let pair = pairs[0];
let timer = null, sent = 0;
function counted() { $("count").textContent = source.value.length + " / " + limit; }
async function request(q, n) {
  const r = await fetch("translate", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({q: q, source: pair[0], target: pair[1], format: "text",
                          alternatives: n})});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.status);
  return body;
}
function showAlternatives(list) {
  alts.replaceChildren(...(list || []).map((text) => {
    const li = document.createElement("li");
    li.textContent = text; li.title = "use this translation";
    li.addEventListener("click", () => {  // the chosen one and the shown one change places
      const shown = result.textContent; result.textContent = text; li.textContent = shown;
    });
    return li;
  }));
}
async function translate() {
  const q = source.value, mine = ++sent;
  counted();
  if (!q.trim()) { result.textContent = ""; status.textContent = ""; showAlternatives([]); return; }
  status.className = ""; status.textContent = "translating...";
  try {
    const body = await request(q, wanted);
    if (mine !== sent) return;  // a newer request is on its way
    result.textContent = body.translatedText;
    showAlternatives(body.alternatives);
    status.textContent = body.truncated ? "lines too long were cut: " + body.truncated.join(", ") : "";
  } catch (e) {
    if (mine !== sent) return;
    status.className = "error"; status.textContent = "error: " + e.message;
  }
}
source.addEventListener("input", () => {
  counted(); clearTimeout(timer); timer = setTimeout(translate, 300);
});
source.addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
$("go").addEventListener("click", translate);
function example() {
  const body = {q: "Hello world.", source: pair[0], target: pair[1]};
  $("curl").textContent = "curl -s " + new URL("translate", location.href).href +
    " -H 'Content-Type: application/json' -d '" + JSON.stringify(body) + "'";
}
$("pair").addEventListener("change", () => {
  pair = pairs[$("pair").selectedIndex];
  $("title").textContent = "Translate " + pair[2] + " to " + pair[3];
  $("srcname").textContent = pair[2] + " (" + pair[0] + ")";
  $("tgtname").textContent = pair[3] + " (" + pair[1] + ")";
  example(); translate();
});
$("clear").addEventListener("click", () => {
  source.value = ""; result.textContent = ""; status.textContent = ""; showAlternatives([]); counted();
  source.focus();
});
$("copy").addEventListener("click", async () => {
  try { await navigator.clipboard.writeText(result.textContent); status.textContent = "copied"; }
  catch (e) {  // no clipboard permission (an http page): select the text for the user to copy
    const range = document.createRange(); range.selectNodeContents(result);
    getSelection().removeAllRanges(); getSelection().addRange(range); status.textContent = "selected";
  }
});
$("file").addEventListener("change", async () => {
  const file = $("file").files[0];
  if (!file) return;
  status.className = ""; status.textContent = "translating " + file.name + "...";
  try {
    const text = await file.text();
    if (text.length > limit)
      throw new Error(file.name + " has " + text.length + " characters; the limit is " + limit);
    const body = await request(text, 0);
    const link = $("download");
    if (link.href) URL.revokeObjectURL(link.href);
    link.href = URL.createObjectURL(new Blob([body.translatedText], {type: "text/plain;charset=utf-8"}));
    link.download = file.name.replace(/(\\.txt)?$/, "." + pair[1] + ".txt");
    link.hidden = false; link.textContent = "Download " + link.download;
    status.textContent = "";
  } catch (e) { status.className = "error"; status.textContent = "error: " + e.message; }
});
example();
const given = new URLSearchParams(location.search).get("q");
if (given) { source.value = given; translate(); }
counted();
</script>
</body></html>
"""


def page_html(shown: dict, pairs: list[tuple[str, str]] | None = None) -> str:
    """The page at /: everything inline, so it works with no network beyond this server. `pairs`: every
    (source, target) the server answers, offered in a list where there are several; default the shown one."""
    esc = html.escape
    pairs = pairs or [(shown["source"], shown["target"])]

    def lang(code: str) -> str:
        return f"{language_name(code)} ({code})"

    settings = "".join(f"<dt>{esc(k.replace('_', ' '))}</dt><dd>{esc(str(v))}</dd>" for k, v in shown.items())
    options = "".join(f"<option>{esc(f'{lang(s)} to {lang(t)}')}</option>" for s, t in pairs)
    # JSON inside <script>: "<" escaped, so no code can close the element
    listed = json.dumps([[s, t, language_name(s), language_name(t)] for s, t in pairs]).replace(
        "<", "\\u003c"
    )
    return (
        PAGE.replace(
            "__PAIRNAMES__", esc(f"{language_name(shown['source'])} to {language_name(shown['target'])}")
        )
        .replace("__PAIR__", esc(f"{shown['source']} to {shown['target']}"))
        .replace("__ONEPAIR__", "hidden" if len(pairs) == 1 else "")
        .replace("__OPTIONS__", options)
        .replace("__PAIRS__", listed)
        .replace("__ALTS__", str(min(2, int(shown.get("max_alternatives", 0)))))
        .replace("__SRC__", esc(lang(shown["source"])))
        .replace("__TGT__", esc(lang(shown["target"])))
        .replace("__MAX__", str(shown["max_chars"]))
        .replace("__SETTINGS__", settings)
    )
