#!/bin/bash
# Usage (root, from the workspace, after `cargo build --release`): proxy-userland/benches/outside/socket_path_ab.sh
# Needs ab (apache2-utils) and nginx. CPU=1 N=10000 ROUNDS=5 FILL=1 by default.
#
# Outside check of the socket path: ab (a new connection per request) against nginx in a
# pod namespace, client and server pinned to one CPU; direct (client outside the hooked
# cgroup) vs pod IP through the hooks vs ClusterIP, at 10,000 services, after more
# translated connections than the reverse-NAT map holds. Cleans up on exit.
set -u
CPU=${CPU:-1}
N=${N:-10000}
ROUNDS=${ROUNDS:-5}
FASTPATH=${FASTPATH:-target/release/fastpath}
CG=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/self/mounts)

# Everything lives in $WB (made here, removed on exit).
WB=$(mktemp -d /tmp/fastpath-ab.XXXXXX)
mkdir -p $WB/manifests
python3 - "$WB" <<'PY'
import sys
wb = sys.argv[1]
docs = []
for i in range(9999):
    ip = f"198.19.{1 + i // 250}.{i % 250 + 1}"
    eps = ", ".join(
        "{addresses: [198.18.%d.%d], conditions: {ready: true}}" % (i * 10 // 250 % 250, (i * 10 + e) % 250 + 1)
        for e in range(10))
    docs.append(f"""apiVersion: v1
kind: Service
metadata: {{name: s{i}, namespace: bench}}
spec:
  clusterIP: {ip}
  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: s{i}-1, namespace: bench, labels: {{kubernetes.io/service-name: s{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints: [{eps}]
""")
docs.append("""apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [198.18.200.2], conditions: {ready: true}}]
""")
for c in range(0, len(docs), 500):
    open(f"{wb}/manifests/m{c // 500:03d}.yaml", "w").write("---\n".join(docs[c:c + 500]))
open(f"{wb}/nginx.conf", "w").write(f"""worker_processes 1;
daemon off;
pid {wb}/nginx.pid;
error_log {wb}/nginx-error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  server {{ listen 198.18.200.2:8080 backlog=4096; location / {{ return 200 "ok\\n"; }} }}
}}
""")
PY
cleanup() {
  [ -n "${DPID:-}" ] && kill $DPID 2>/dev/null && wait $DPID 2>/dev/null
  [ -f $WB/nginx.pid ] && kill $(cat $WB/nginx.pid) 2>/dev/null
  sleep 0.5
  for cg in wbclient wbdirect; do
    [ -d $CG/$cg ] && { for p in $(cat $CG/$cg/cgroup.procs); do echo $p > $CG/cgroup.procs; done; rmdir $CG/$cg; }
  done
  ip netns del wb-node 2>/dev/null; ip netns del wb-pod 2>/dev/null
  rm -rf "$WB"
}
trap cleanup EXIT
ip netns add wb-node; ip netns add wb-pod
ip link add wbv0 netns wb-node type veth peer name wbv1 netns wb-pod
ip -n wb-node addr add 198.18.200.1/24 dev wbv0; ip -n wb-node link set wbv0 up; ip -n wb-node link set lo up
ip -n wb-pod addr add 198.18.200.2/24 dev wbv1; ip -n wb-pod link set wbv1 up; ip -n wb-pod link set lo up
ip netns exec wb-node sysctl -q -w net.ipv4.ip_local_port_range="10000 65000" net.ipv4.tcp_tw_reuse=1
ip netns exec wb-pod sysctl -q -w net.core.somaxconn=4096
mkdir -p $CG/wbclient $CG/wbdirect
ip netns exec wb-pod taskset -c $CPU nginx -c $WB/nginx.conf & 
sleep 0.5
$FASTPATH --manifests $WB/manifests --cgroup-path $CG/wbclient --proxy-mode ebpf --netns wb-node --hostname-override node-a \
  --nodeport-devices none --healthz-bind-address 127.0.0.1:18256 --metrics-bind-address 127.0.0.1:18249 \
  > $WB/daemon.log 2>&1 &
DPID=$!
for i in $(seq 1 60); do curl -sf http://127.0.0.1:18256/readyz >/dev/null && break; sleep 0.5; done
echo "daemon ready after ~$((i/2)) s"
# ab from inside a cgroup, in the node namespace (join the cgroup first: ip netns exec hides cgroup2).
ab_in() { # cgroup url n
  sh -c "echo \$\$ > $CG/$1/cgroup.procs && exec ip netns exec wb-node taskset -c $CPU ab -q -n $3 -c 1 $2" 2>&1 \
    | awk '/Requests per second/ {print $4} /Failed requests/ {f=$3} END {if (f>0) print "FAILED " f}'
}
echo "warm: $(ab_in wbclient http://198.19.0.10/ 2000)"
if [ "${FILL:-1}" = 1 ]; then
  for k in $(seq 1 28); do ab_in wbclient http://198.19.0.10/ 10000 >/dev/null; done
  echo "filled: 280,000 ClusterIP connections; revnat entries: $(curl -s http://127.0.0.1:18249/metrics | grep 'fastpath_bpf_map_entries{map="sock_revnat"}')"
fi
echo "load: $(cat /proc/loadavg)"
for r in $(seq 1 $ROUNDS); do
  d=$(ab_in wbdirect http://198.18.200.2:8080/ $N)
  p=$(ab_in wbclient http://198.18.200.2:8080/ $N)
  c=$(ab_in wbclient http://198.19.0.10/ $N)
  echo "round $r: direct $d  pod-IP-through-hooks $p  ClusterIP $c  (req/s)"
done
echo "load: $(cat /proc/loadavg)"
