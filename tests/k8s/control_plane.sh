#!/usr/bin/env bash
# A real Kubernetes control plane for `make test-k8s`: etcd + kube-apiserver + kube-controller-manager +
# kube-scheduler, built from Debian bookworm's own packages (no containers, no downloads outside Debian).
#
#   tests/k8s/control_plane.sh install   # apt packages; compiles the binaries once per machine (cached)
#   tests/k8s/control_plane.sh start     # fresh etcd + apiserver (RBAC on) + controllers; prints KUBECONFIG
#   tests/k8s/control_plane.sh stop
#
# Where things go (environment):
#   PDSERVE_K8S_CACHE  compiled binaries, outside the repository   (default ~/.cache/pdserve/k8s)
#   PDSERVE_K8S_RUN    certificates, etcd data, logs, kubeconfig   (default /tmp/pdserve-k8s)
#   PDSERVE_K8S_PORT   apiserver port (etcd takes 12379-12381)     (default 16443)
#
# Kubernetes comes from Debian's source package `kubernetes` (1.20.2; Debian itself builds only kubectl
# from it) compiled with Debian's Go. Its vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18 when
# json-iterator meets a map, so it is swapped for Debian's reflect2 1.0.2 before building.
set -euo pipefail

CACHE=${PDSERVE_K8S_CACHE:-$HOME/.cache/pdserve/k8s}
BIN=$CACHE/bin
RUN=${PDSERVE_K8S_RUN:-/tmp/pdserve-k8s}
PORT=${PDSERVE_K8S_PORT:-16443}
ETCD_PORT=12379
KCM_PORT=16257
SCHED_PORT=16259
BINARIES="kube-apiserver kube-controller-manager kube-scheduler"
ADMIN_TOKEN=pdserve-test-admin

say() { echo "[control-plane] $*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

cmd_install() {
  export DEBIAN_FRONTEND=noninteractive
  local src_list=/etc/apt/sources.list.d/pdserve-debian-src.sources
  if [ ! -f "$src_list" ]; then
    # `apt-get source` needs deb-src entries: the machine's own mirrors, as source.
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources | as_root tee "$src_list" >/dev/null
  fi
  # (prometheus: not for the control plane, for the autoscaler's Prometheus source test beside it)
  local packages="etcd-server golang-go golang-github-modern-go-reflect2-dev dpkg-dev make gcc libc6-dev rsync openssl curl prometheus"
  local missing_pkgs="" p
  for p in $packages; do
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing_pkgs="$missing_pkgs $p"
  done
  if [ -n "$missing_pkgs" ]; then
    as_root apt-get update -qq
    # shellcheck disable=SC2086
    as_root apt-get install -y -qq --no-install-recommends $missing_pkgs >/dev/null
  fi
  local targets="" b
  for b in $BINARIES; do [ -x "$BIN/$b" ] || targets="$targets cmd/$b"; done
  if [ -z "$targets" ]; then say "binaries cached in $BIN"; return 0; fi
  local work; work=$(mktemp -d /tmp/pdserve-k8s-src.XXXXXX)
  (cd "$work" && apt-get source -qq kubernetes >/dev/null 2>&1) || { say "apt-get source kubernetes failed"; exit 1; }
  local src; src=$(find "$work" -maxdepth 1 -type d -name 'kubernetes-*' | head -1)
  [ -d "$src/cmd/kube-apiserver" ] || { say "no kubernetes source tree in $work"; exit 1; }
  rm -rf "$src/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$src/vendor/github.com/modern-go/reflect2"
  say "compiling$targets from $(basename "$src") with $(go version | cut -d' ' -f3): a cold build takes 13-20 min on 2 cores"
  local t0=$SECONDS
  (cd "$src" && HOME="$work/home" make WHAT="${targets# }" >"$work/build.log" 2>&1) \
    || { tail -40 "$work/build.log" >&2; say "build failed"; exit 1; }
  mkdir -p "$BIN"
  for b in $targets; do install -m 0755 "$src/_output/bin/${b#cmd/}" "$BIN/"; done
  say "compiled in $((SECONDS - t0)) s into $BIN"
  rm -rf "$work"
}

launch() {  # name, command...: detached, its own session, pid file and log in $RUN
  local name=$1; shift
  setsid "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

await_ok() {  # url, seconds
  local url=$1 deadline=$((SECONDS + $2))
  until curl -fsS --max-time 2 -k -H "Authorization: Bearer $ADMIN_TOKEN" "$url" 2>/dev/null | grep -q '^ok'; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

make_pki() {
  local d=$RUN/pki
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$d/ca.key" -out "$d/ca.crt" -days 30 -subj /CN=pdserve-test-ca 2>/dev/null
  printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n' >"$d/san.cnf"
  openssl req -newkey rsa:2048 -nodes -keyout "$d/apiserver.key" -out "$d/apiserver.csr" -subj /CN=kube-apiserver 2>/dev/null
  openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -out "$d/apiserver.crt" -days 30 -extfile "$d/san.cnf" -extensions ext 2>/dev/null
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  echo "$ADMIN_TOKEN,admin,admin,system:masters" >"$d/tokens.csv"
}

kubeconfig() {  # file, token
  cat >"$1" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: pdserve-test
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$RUN/pki/ca.crt"}
users:
- name: user
  user: {token: "$2"}
contexts:
- name: pdserve-test
  context: {cluster: pdserve-test, user: user, namespace: default}
current-context: pdserve-test
KUBECONFIG
}

cmd_start() {
  local b
  for b in $BINARIES; do [ -x "$BIN/$b" ] || { say "$BIN/$b missing: run '$0 install'"; exit 1; }; done
  cmd_stop >/dev/null 2>&1 || true
  rm -rf "$RUN" && mkdir -p "$RUN"
  make_pki
  kubeconfig "$RUN/kubeconfig" "$ADMIN_TOKEN"
  local t0=$SECONDS
  launch etcd etcd --name pdserve-test --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "pdserve-test=http://127.0.0.1:$((ETCD_PORT + 1))" \
    --listen-metrics-urls "http://127.0.0.1:$((ETCD_PORT + 2))"
  # RBAC is enforced: the operator runs under its chart's ServiceAccount, not as admin.
  launch kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$PORT" --insecure-port=0 \
    --tls-cert-file="$RUN/pki/apiserver.crt" --tls-private-key-file="$RUN/pki/apiserver.key" \
    --client-ca-file="$RUN/pki/ca.crt" --token-auth-file="$RUN/pki/tokens.csv" \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$RUN/pki/sa.pub" --service-account-signing-key-file="$RUN/pki/sa.key" \
    --authorization-mode=Node,RBAC --service-cluster-ip-range=10.0.0.0/24 \
    --enable-priority-and-fairness=false --endpoint-reconciler-type=none
  await_ok "https://127.0.0.1:$PORT/readyz" 120 || { tail -30 "$RUN/kube-apiserver.log" >&2; say "apiserver not ready"; exit 1; }
  launch kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$RUN/kubeconfig" \
    --authentication-kubeconfig="$RUN/kubeconfig" --authorization-kubeconfig="$RUN/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$KCM_PORT" \
    --service-account-private-key-file="$RUN/pki/sa.key" --root-ca-file="$RUN/pki/ca.crt" \
    --controllers='*,-nodeipam,-cloud-node-lifecycle'
  launch kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$RUN/kubeconfig" \
    --authentication-kubeconfig="$RUN/kubeconfig" --authorization-kubeconfig="$RUN/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$SCHED_PORT"
  await_ok "https://127.0.0.1:$KCM_PORT/healthz" 60 || { tail -20 "$RUN/kube-controller-manager.log" >&2; exit 1; }
  await_ok "https://127.0.0.1:$SCHED_PORT/healthz" 60 || { tail -20 "$RUN/kube-scheduler.log" >&2; exit 1; }
  say "control plane ready in $((SECONDS - t0)) s"
  echo "$RUN/kubeconfig"
}

cmd_stop() {
  local name pid
  for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -f "$RUN/$name.pid" ] || continue
    pid=$(cat "$RUN/$name.pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true  # the apiserver may hang on open watches
    rm -f "$RUN/$name.pid"
  done
}

case "${1:-}" in
  install | start | stop) "cmd_$1" ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
