#!/usr/bin/env bash
# Before (/work/base = 1c55ba6) and after (/work/main) benchmarks, interleaved, on a quiet machine.
set -u
out=/tmp/ab
log() { echo "[$(date +%T)] $*" | tee -a $out/log.txt; }
uptime >> $out/log.txt
for round in 1 2; do
  for tree in base main; do
    log "serve $tree round $round"
    (cd /work/$tree && timeout 900 .venv/bin/shoal bench serve --concurrency 32 --concurrency 8 --rounds 3 --json $out/serve-$tree-$round.json > $out/serve-$tree-$round.txt 2>&1)
  done
done
for tree in base main; do
  log "migration $tree"
  (cd /work/$tree && timeout 1200 .venv/bin/shoal bench migration --seq-lens 256,2048,8192 --repeats 3 --json $out/migration-$tree.json --plot $out/migration-$tree.png > $out/migration-$tree.txt 2>&1)
done
for tree in base main; do
  log "cluster $tree"
  (cd /work/$tree && timeout 900 .venv/bin/shoal bench cluster --rates 100,500 --duration 20 --json $out/cluster-$tree.json > $out/cluster-$tree.txt 2>&1)
done
uptime >> $out/log.txt
log done
