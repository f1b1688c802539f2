# Sourced by the serving scripts: wait_server PORT PID LOG waits (up to 300 s) until the server
# at PORT answers /health; if process PID dies first, prints LOG's tail and exits 1.
wait_server() {
  local port=$1 pid=$2 log=$3 i
  for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { echo "server up after ${i}s"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "server died"; tail -30 "$log"; exit 1; }
    sleep 1
  done
  echo "server not up after 300 s"; exit 1
}
