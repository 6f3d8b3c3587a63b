#!/usr/bin/env bash
# moonrl report's page rendered by headless Chromium (Debian package chromium): the screenshot,
# taken with JavaScript off (the plots must not need it), is not blank and shows both runs'
# colours; the DOM after rendering holds every plot with its title and the memory headline. Skipped (77) without chromium.
# The screenshots are of copies of the pages without their <script> (the plots must not need it).
# usage: test_report_render.sh PATH/TO/moonrl PATH/TO/png_ink.py
set -u
MOONRL=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
INK=$2
CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROMIUM" ]; then echo "skip: no chromium (apt-get install chromium)"; exit 77; fi
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, check NAME COMMAND..., summary

. "$(dirname "$0")/make_runs.sh"
make_runs "$tmp"

# chromium headless, with its profile in tmp; --no-sandbox as the tests may run as root
chrome() {
  timeout 90 "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --user-data-dir="$tmp/profile" --window-size="${SIZE:-1280,1600}" "$@" 2> "$tmp/chromium.log"
}

out=$("$MOONRL" report "$tmp/a" "$tmp/b" -o "$tmp/cmp.html" 2>&1)
check "the comparison page is written ($out)" [ -s "$tmp/cmp.html" ]
plots=$(printf '%s' "$out" | sed -n 's/.* \([0-9]*\) plots)$/\1/p')
# a copy of a page without its script
noscript() { /usr/bin/python3 -c 'import re, sys; sys.stdout.write(re.sub(r"(?s)<script>.*?</script>", "", open(sys.argv[1]).read()))' "$1" > "$2"; }
noscript "$tmp/cmp.html" "$tmp/cmp-nojs.html"
check "the copy has no script" bash -c "! grep -q '<script' '$tmp/cmp-nojs.html'"

chrome --screenshot="$tmp/cmp.png" "file://$tmp/cmp-nojs.html" > /dev/null
if [ ! -s "$tmp/cmp.png" ]; then
  bad "chromium wrote no screenshot:"; tail -20 "$tmp/chromium.log"
else
  read -r w h ink run1 run2 < <(/usr/bin/python3 "$INK" "$tmp/cmp.png" '#1f77b4' '#d62728' | tr '\n' ' ')
  echo "screenshot ${w}x$h: non-white share $ink, run colours $run1 and $run2 pixels"
  check "the screenshot is not blank" /usr/bin/python3 -c "import sys; sys.exit(0 if $ink > 0.02 else 1)"
  check "the first run's lines are drawn" [ "$run1" -gt 600 ]
  check "the second run's lines are drawn" [ "$run2" -gt 600 ]
fi

chrome --dump-dom "file://$tmp/cmp.html" > "$tmp/dom.html"
check "the DOM after rendering holds every plot ($plots)" [ "$(grep -o '<svg' "$tmp/dom.html" | wc -l)" -eq "$plots" ]
missing=""
for k in reward/mean accuracy approx_kl entropy clip_frac grad_norm lr response_length/mean tokens_per_s/generate \
         mismatch/mean_abs time/step 'seconds per phase: a' 'seconds per phase: b'; do
  grep -q "<title>$k</title>" "$tmp/dom.html" || missing="$missing '$k'"
done
check "the plots have their titles${missing:+ (missing:$missing)}" [ -z "$missing" ]
check "the header says each run's peak resident memory" [ "$(grep -o '<div class="memhead">' "$tmp/dom.html" | wc -l)" -eq 2 ]
check "the memory section with a bar per run" [ "$(grep -o 'class="membar"' "$tmp/dom.html" | wc -l)" -eq 2 ]

# the synthetic run (NaN, inf, one-step metrics) and the run with no metrics render too
"$MOONRL" report "$tmp/syn" > /dev/null && "$MOONRL" report "$tmp/empty" > /dev/null
noscript "$tmp/syn/report.html" "$tmp/syn-nojs.html"
SIZE=1280,1000 chrome --screenshot="$tmp/syn.png" "file://$tmp/syn-nojs.html" > /dev/null
if [ -s "$tmp/syn.png" ]; then
  read -r w h ink run1 < <(/usr/bin/python3 "$INK" "$tmp/syn.png" '#1f77b4' | tr '\n' ' ')
  check "the synthetic run's page is not blank ($ink, $run1 run-colour pixels)" [ "$run1" -gt 600 ]
else
  bad "no screenshot of the synthetic run"
fi
chrome --dump-dom "file://$tmp/empty/report.html" > "$tmp/empty.html"
check "the empty run's page says it has no metrics" grep -q 'empty has no metrics' "$tmp/empty.html"

summary
