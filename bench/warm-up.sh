# Sourced by the cluster profiling scripts. `warm_up WHAT` runs small cycle
# loads against "$servers" with "$gen" until one is answered in full (no
# busy, no not-granted answer: the cluster has a leader and every node
# applies what it is sent), then 2,000 requests at "$conns" x "$depth".
# Exits with "WHAT never granted" after 120 tries a second apart.
warm_up() {
  local ready=0
  for _ in $(seq 1 120); do
    if "$gen" --server "$servers" --connections 3 --mode cycle --requests 30 \
         --quiet --json >"$tmp/warm.json" 2>/dev/null &&
       grep -q '"busy":0,' "$tmp/warm.json" && grep -q '"not_granted":0,' "$tmp/warm.json"; then
      ready=1; break
    fi
    sleep 1
  done
  [ "$ready" = 1 ] || { echo "$1 never granted" >&2; exit 1; }
  "$gen" --server "$servers" --connections "$conns" --depth "$depth" --mode cycle \
    --requests 2000 --quiet --json >/dev/null
}
