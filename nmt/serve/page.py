"""The page at `/` to try the model: no external assets, so it works offline."""

from __future__ import annotations

import html

from nmt.serve.api import LANGUAGE_NAMES

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
button { font: inherit; margin: .5em 0; padding: .3em 1.2em; }
#status { color: #666; min-height: 1.4em; }
#status.error { color: #b00; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; color: #555; font-size: 90%; }
dd { margin: 0; }
</style></head>
<body>
<h1>Translate __PAIR__</h1>
<div class="panes">
<label class="pane"><span>__SRC__</span>
<textarea id="source" maxlength="__MAX__" autofocus placeholder="Type text to translate"></textarea></label>
<div class="pane"><span>__TGT__</span><output id="result" for="source" aria-live="polite"></output></div>
</div>
<button id="go" type="button">Translate</button> <span id="status"></span>
<dl>__SETTINGS__</dl>
<script>
const source = document.getElementById("source"), result = document.getElementById("result");
const status = document.getElementById("status");
let timer = null, sent = 0;
async function translate() {
  const q = source.value, mine = ++sent;
  if (!q.trim()) { result.textContent = ""; status.textContent = ""; return; }
  status.className = ""; status.textContent = "translating...";
  try {
    const r = await fetch("translate", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({q: q, source: "__SRCCODE__", target: "__TGTCODE__", format: "text"})});
    const body = await r.json();
    if (mine !== sent) return;  // a newer request is on its way
    if (!r.ok) throw new Error(body.error || r.status);
    result.textContent = body.translatedText;
    status.textContent = body.truncated ? "lines too long were cut: " + body.truncated.join(", ") : "";
  } catch (e) {
    if (mine !== sent) return;
    status.className = "error"; status.textContent = "error: " + e.message;
  }
}
source.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(translate, 300); });
source.addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) translate(); });
document.getElementById("go").addEventListener("click", translate);
const given = new URLSearchParams(location.search).get("q");
if (given) { source.value = given; translate(); }
</script>
</body></html>
"""


def page_html(shown: dict) -> str:
    """The page at /: everything inline, so it works with no network beyond this server."""
    esc = html.escape

    def lang(code: str) -> str:
        return f"{LANGUAGE_NAMES.get(code, code)} ({code})"

    settings = "".join(f"<dt>{esc(k.replace('_', ' '))}</dt><dd>{esc(str(v))}</dd>" for k, v in shown.items())
    return (
        PAGE.replace("__PAIR__", esc(f"{shown['source']} to {shown['target']}"))
        .replace("__SRCCODE__", esc(shown["source"]))
        .replace("__TGTCODE__", esc(shown["target"]))
        .replace("__SRC__", esc(lang(shown["source"])))
        .replace("__TGT__", esc(lang(shown["target"])))
        .replace("__MAX__", str(shown["max_chars"]))
        .replace("__SETTINGS__", settings)
    )
