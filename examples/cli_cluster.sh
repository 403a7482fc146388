#!/usr/bin/env bash
# The tutorial's cluster, step by step (docs/tutorial.rst): a coordinator, two relays ("hosts")
# and four simulated ranks, each its own process on loopback; then the status page and a plot.
# Run it from a clone: `. .venv/bin/activate` first, or let it find .venv/bin/flodl-trio; or
# choose the command: FLODL=".venv/bin/python -m flodl_trio" bash examples/cli_cluster.sh
set -euo pipefail
if [ -z "${FLODL:-}" ]; then
  if command -v flodl-trio > /dev/null; then FLODL=flodl-trio; else FLODL=.venv/bin/flodl-trio; fi
fi
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

wait_for_line() {  # FILE TEXT: up to 30 s for a line containing TEXT
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "no '$2' in $1" >&2
  return 1
}

# [step-salt]
$FLODL salt > "$work/salt"   # 32 hex characters; every process of the run needs the same one
export FLODL_SALT_HEX="$(cat "$work/salt")"
# [/step-salt]

# [step-coordinator]
$FLODL coordinator --listen 127.0.0.1:0 --world-size 4 --epochs 2 --total-samples 64 \
    --batch-size 4 --timeline "$work/timeline.jsonl" > "$work/coordinator.out" &
coordinator=$!
wait_for_line "$work/coordinator.out" "coordinator listening on"
COORD="$(awk '/coordinator listening on/ {print $NF}' "$work/coordinator.out")"
# [/step-coordinator]

# [step-relays]
$FLODL relay --coordinator "$COORD" --host host-a --ranks 0-1 --world-size 4 > "$work/a.out" &
$FLODL relay --coordinator "$COORD" --host host-b --ranks 2-3 --world-size 4 > "$work/b.out" &
wait_for_line "$work/a.out" "listening for ranks on"
wait_for_line "$work/b.out" "listening for ranks on"
RELAY_A="$(awk '/listening for ranks on/ {print $NF}' "$work/a.out")"
RELAY_B="$(awk '/listening for ranks on/ {print $NF}' "$work/b.out")"
# [/step-relays]

# [step-status]
$FLODL status "$COORD"   # phase forming: relays join once their own ranks are connected
# [/step-status]

# [step-ranks]
for rank in 0 1; do
  $FLODL rank --relay "$RELAY_A" --rank $rank --world-size 4 --batch-size 4 --batch-ms 5 &
done
for rank in 2 3; do
  $FLODL rank --relay "$RELAY_B" --rank $rank --world-size 4 --batch-size 4 --batch-ms 5 &
done
wait "$coordinator"   # exit code 0: both epochs completed
tail -n 1 "$work/coordinator.out"   # {"summary": {"epochs_completed": 2, ...}}
# [/step-ranks]

# [step-plot]
$FLODL plot "$work/timeline.jsonl" -o "$work/timeline.png"   # needs matplotlib
# [/step-plot]
wait   # every relay and rank exits 0 after the coordinator's Shutdown
echo "tutorial cluster: done"
